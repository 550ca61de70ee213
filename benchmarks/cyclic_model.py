"""A random-weight checkpoint rewritten so that its greedy output is a fixed cycle of tokens, at the
source's full shape and cost: for speculative decoding at full acceptance without real weights.

Every layer's o_proj and down_proj are zeroed (attention and MLP still run at full size, so a
forward costs what the real shape costs), so the final hidden state is the last token's
embedding. Embedding dim i is a one-hot state for cycle token i, dim M for every other token;
lm_head maps state i to cycle token i+1 (the last back to the first) and the other state to the
first. The argmax margin is large, so 1-row and many-row products agree exactly (random weights
flip argmax between them, which makes self-drafting accept almost nothing). A different source of
the same vocabulary (a draft shape) rewritten with the same cycle predicts the same tokens.

Works on the safetensors files directly (any family with these tensor names; untied lm_head), so
both our server and mlx_lm.server load the result.

    python benchmarks/cyclic_model.py SRC DST [--cycle 64] [--first-id 2000]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

STATE_VALUE = 4.0  # the one-hot state's value in the embedding
LOGIT_WEIGHT = 1.0  # lm_head's weight on it: after RMSNorm a logit of ~30 against 0
NOISE = 0.1  # the embedding's other dims: keys and values still differ per token


def cycle_ids(length: int, first_id: int) -> list[int]:
    return list(range(first_id, first_id + length))


def rewrite(name: str, w: mx.array, cycle: list[int]) -> mx.array:
    m = len(cycle)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return mx.zeros_like(w)
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return mx.zeros_like(w)
    if name.endswith("norm.weight") and "q_norm" not in name and "k_norm" not in name:
        return mx.ones_like(w)
    if name == "model.embed_tokens.weight":
        vocab, hidden = w.shape
        if hidden <= m + 1:
            raise SystemExit(f"hidden size {hidden} cannot hold a cycle of {m}")
        state = mx.full((vocab,), m, dtype=mx.int32)
        state[mx.array(cycle)] = mx.arange(m, dtype=mx.int32)
        dims = mx.arange(hidden)[None, :]
        onehot = (dims == state[:, None]).astype(mx.float32) * STATE_VALUE
        noise = mx.random.normal((vocab, hidden), key=mx.random.key(7)) * NOISE
        out = mx.where(dims > m, noise, onehot).astype(w.dtype)
        mx.eval(out)
        return out
    if name == "lm_head.weight":
        vocab, hidden = w.shape
        rows = mx.array([*cycle[1:], cycle[0], cycle[0]])  # state i -> cycle[i+1]; other -> cycle[0]
        cols = mx.arange(m + 1)
        out = mx.zeros((vocab, hidden), dtype=w.dtype)
        out[rows, cols] = LOGIT_WEIGHT
        mx.eval(out)
        return out
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--cycle", type=int, default=64)
    p.add_argument("--first-id", type=int, default=2000)
    args = p.parse_args()
    src, dst = Path(args.src), Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    cycle = cycle_ids(args.cycle, args.first_id)
    config = json.loads((src / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        raise SystemExit("a cyclic model needs an untied lm_head")
    if config.get("quantization"):
        raise SystemExit("a cyclic model is rewritten from a float checkpoint")
    seen = set()
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            weights = mx.load(str(f))
            out = {name: rewrite(name, w, cycle) for name, w in weights.items()}
            seen.update(out)
            mx.save_safetensors(str(dst / f.name), out, metadata={"format": "mlx"})
            del weights, out
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    if "lm_head.weight" not in seen:
        raise SystemExit("no lm_head.weight: a cyclic model needs an untied lm_head")
    (dst / "cycle.json").write_text(json.dumps(cycle))
    print(f"cyclic_model: {dst} cycles through {len(cycle)} tokens from id {cycle[0]}", flush=True)


if __name__ == "__main__":
    main()
