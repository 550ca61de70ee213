"""Speculative decoding cost and speed at B=1, engine level (no HTTP), on one target model dir.

1. The verification forward's cost: seconds for a forward of K + 1 tokens (K = 1..8) against a
   plain decode step, at a --prompt-tokens context, and the break-even acceptance rate per K
   (where the expected tokens per verification, (1 - a^(K+1)) / (1 - a), pay for its cost).
2. End to end, one row of --max-tokens greedy tokens after a --prompt-tokens prompt: plain
   decoding; the target as its own draft (every draft accepted: the mechanics at full
   acceptance, with a draft as costly as the target); --draft DIR if given; n-gram lookup. Each
   with drafts verified at every step ("always") and under the measured policy. On a model
   rewritten by benchmarks/cyclic_model.py (its cycle.json beside the weights) the output is a
   fixed cycle that the prompt holds twice: every drafter can be right, and the target as its own
   draft is (random weights flip argmax between a 1-row and a many-row product, so there almost
   nothing is accepted).

    python benchmarks/spec_bench.py --model DIR [--draft DIR] --prompt-tokens 512 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.engine.speculation import Speculation  # noqa: E402
from model.kv.cache import make_caches  # noqa: E402
from model.load.loader import load_model  # noqa: E402


def forward_cost(model, prompt: list[int], ks: list[int], reps: int) -> dict[int, float]:
    """Seconds per forward of L tokens after the prompt (L = 1 is a plain decode step)."""
    caches = make_caches(len(model.layers))
    model(mx.array(prompt)[None], caches)
    mx.eval([c.state for c in caches])
    out = {}
    for L in [1] + [k + 1 for k in ks]:
        tokens = mx.array([prompt[:L]])
        for _ in range(3):  # warm: kernels, graphs
            mx.eval(model.logits(model(tokens, caches)))
            for c in caches:
                c.trim(L)
        started = time.perf_counter()
        for _ in range(reps):
            mx.eval(model.logits(model(tokens, caches)))
            for c in caches:
                c.trim(L)
        out[L] = (time.perf_counter() - started) / reps
    return out


def prefill_seconds(model, prompt: list[int], reps: int = 3) -> float:
    """Seconds to prefill `prompt` into fresh caches (best of `reps`, after one warm run)."""
    best = float("inf")
    for i in range(reps + 1):
        caches = model.make_caches()
        started = time.perf_counter()
        for start in range(0, len(prompt), 512):
            model(mx.array(prompt[start : start + 512])[None], caches)
            mx.eval([c.state for c in caches])
        if i:
            best = min(best, time.perf_counter() - started)
    return best


def break_even(cost_ratio: float, k: int) -> float | None:
    """The acceptance rate a at which (1 - a^(k+1)) / (1 - a) == cost_ratio (None: never)."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < cost_ratio:
            lo = a
        else:
            hi = a
    return round(hi, 3)


def decode(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    engine.open_row(RowSpec(0, tuple(prompt), SamplingParams(), max_tokens))
    while engine.prefill(0).remaining:
        pass
    first = engine.join(0)
    tokens, drafted, accepted = [first.token], 0, 0
    started = time.perf_counter()
    while len(tokens) < max_tokens:
        for t in engine.step():
            tokens.append(t.token)
            drafted, accepted = drafted + t.drafted, accepted + t.accepted
    seconds = time.perf_counter() - started
    engine.close_row(0)
    return {
        "tok_s": round((len(tokens) - 1) / seconds, 1),
        "drafted": drafted,
        "accepted": accepted,
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ngram-ks", default="3,8", help="n-gram runs, one per K")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    target = load_model(args.model).model
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompt = [3 + (i * 7919) % min(1000, vocab - 3) for i in range(args.prompt_tokens)]
    cycle_file = Path(args.model) / "cycle.json"
    if cycle_file.exists():  # the answer is the cycle: hold it twice at the prompt's end
        cycle = json.loads(cycle_file.read_text())
        prompt = prompt[: max(0, args.prompt_tokens - 2 * len(cycle))] + cycle + cycle
    ks = [int(k) for k in args.ks.split(",")]
    cost = forward_cost(target, prompt, ks, args.reps)
    result: dict = {"device": str(mx.default_device()), "prompt_tokens": args.prompt_tokens, "forward_s": cost}
    print(
        "| K | verify forward ms | x plain step | break-even acceptance | tokens/s at full acceptance, free drafter |"
    )
    print("|---|---|---|---|---|")
    print(f"| 0 (plain) | {cost[1] * 1e3:.2f} | 1.00 | - | {1 / cost[1]:.0f} |")
    for k in ks:
        ratio = cost[k + 1] / cost[1]
        print(f"| {k} | {cost[k + 1] * 1e3:.2f} | {ratio:.2f} | {break_even(ratio, k)} | {(k + 1) / cost[k + 1]:.0f} |")
    runs = {"plain": Engine(target, eos_token_ids=[])}
    drafters = {"self": Speculation("draft", args.k, draft_model=target)}
    for k in (int(k) for k in args.ngram_ks.split(",")):
        drafters[f"ngram{k}"] = Speculation("ngram", k)
    if args.draft:
        draft = load_model(args.draft).model
        drafters["draft"] = Speculation("draft", args.k, draft_model=draft)
        # A row's draft caches start empty, also on a prompt-cache hit: the draft model re-prefills
        # the prompt at the row's first draft. What that costs next to the target's prefill:
        result["prefill_s"] = {"target": prefill_seconds(target, prompt), "draft": prefill_seconds(draft, prompt)}
        print(
            f"prefill of the prompt: target {result['prefill_s']['target'] * 1e3:.1f} ms, draft "
            f"{result['prefill_s']['draft'] * 1e3:.1f} ms"
        )
    for name, spec in drafters.items():
        for always in (True, False):
            label = f"{name}-{'always' if always else 'measured'}"
            runs[label] = Engine(
                target, eos_token_ids=[], speculation=Speculation(**{**_fields(spec), "always": always})
            )
    e2e = {}
    base = None
    print("\n| run | tok/s | x plain | drafted | accepted | same tokens |")
    print("|---|---|---|---|---|---|")
    for label, engine in runs.items():
        decode(engine, prompt, 24)  # warm: compiled graphs, the draft's kernels
        r = decode(engine, prompt, args.max_tokens)
        base = base or r
        same = r["tokens"] == base["tokens"]
        e2e[label] = {
            **{k: v for k, v in r.items() if k != "tokens"},
            "x_plain": round(r["tok_s"] / base["tok_s"], 2),
            "same_tokens": same,
        }
        print(
            f"| {label} | {r['tok_s']} | {r['tok_s'] / base['tok_s']:.2f} | {r['drafted']} | {r['accepted']} | {same} |"
        )
    result["e2e"] = e2e
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))


def _fields(spec: Speculation) -> dict:
    return {
        "kind": spec.kind,
        "num_draft_tokens": spec.num_draft_tokens,
        "draft_model": spec.draft_model,
        "ngram_max": spec.ngram_max,
        "ngram_min": spec.ngram_min,
    }


if __name__ == "__main__":
    main()
