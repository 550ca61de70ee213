"""Greedy tokens of quantized models through our server against mlx_lm's generate_step on the same
weights and GPU: one request at a time (a solo row: mlx-lm's exact ops, so they must be equal),
then the same prompts at once (batched rows take the quantized kernels: reported, not required
to be equal — a batched row may differ from its solo run in the last bit, docs/performance.md).

    python benchmarks/quant_parity.py --model DIR [--model DIR2] --tokens 48 --prompts 4 --out parity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import Server, free_port  # noqa: E402


def reference(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    out = []
    for p in prompts:
        toks = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(p), model, max_tokens=n)), range(n))]
        out.append(toks)
    del model
    return out


async def complete(client: httpx.AsyncClient, server: Server, prompt: list[int], n: int) -> list[int]:
    body = {
        "model": server.model_name,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    r = await client.post(f"{server.url}/v1/completions", json=body, timeout=120)
    if r.status_code != 200:  # the server's reason, not just the status
        raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":", 1)[1]) for t in tokens]


def prompt_vocab(model_dir: Path) -> int:
    """How many token ids a prompt may use: the tokenizer's vocabulary where it is smaller than the
    model's embedding (the synthetic checkpoints' tokenizer has 512 tokens under a 151936-row
    embedding, and the server answers 400 for a prompt id the tokenizer does not have)."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    try:
        from tokenizers import Tokenizer

        vocab = min(vocab, Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size())
    except Exception as e:  # noqa: BLE001 - no tokenizer.json: the config's size
        print(f"{model_dir}: tokenizer size unknown ({e!r}); prompt ids below {vocab}", file=sys.stderr)
    return vocab


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def ours(model_dir: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]]]:
    with Server("ours", model_dir, free_port(), []) as server:
        async with httpx.AsyncClient() as client:
            solo = [await complete(client, server, p, n) for p in prompts]
            together = await asyncio.gather(*(complete(client, server, p, n) for p in prompts))
        for line in server.tail(10**7).splitlines():  # which products take the kernels (model/quant_linear.py)
            if "quantized products" in line or "decode attention kernel" in line:
                print(line, file=sys.stderr, flush=True)
    return solo, list(together)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", required=True)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--out", type=Path)
    p.add_argument("--server-logs", type=Path, help="keep our server's output in this folder (serve_bench's option)")
    args = p.parse_args()
    Server.log_dir = args.server_logs
    result = {}
    for model_dir in args.model:
        vocab = prompt_vocab(model_dir)
        prompts = [[(i * 37 + 11 * j) % (vocab - 10) + 5 for i in range(20 + 30 * j)] for j in range(args.prompts)]
        ref = reference(model_dir, prompts, args.tokens)
        solo, together = asyncio.run(ours(model_dir, prompts, args.tokens))
        entry = {
            "solo_equal": [s == r[: len(s)] and len(s) > 0 for s, r in zip(solo, ref)],
            "solo_identical_prefix": [first_diff(s, r) for s, r in zip(solo, ref)],
            "batched_identical_prefix": [first_diff(t, r) for t, r in zip(together, ref)],
            "lengths": [len(s) for s in solo],
        }
        result[str(model_dir)] = entry
        print(f"{model_dir}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
