"""One-off costs the engine pays the first time it meets a shape, versus steady state.

For each batch size B reached by joining rows one at a time (as a server's ramp-up does): the
time of the join (an L=1 forward + merge) and of the first decode steps at the new size against
the steady per-step time. Then prefill: the first forward at each new prompt length against a
repeat at the same length. These separate compile/JIT stalls from real work. Last, a burst of
new-length prompts prefilled one by one against one `Engine.prefill_group` call.

    python benchmarks/warmup_cost.py --model DIR --max-batch 32 [--warm-buckets]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.load.blas import preload_optimized_blas  # noqa: E402

preload_optimized_blas()

import mlx.core as mx  # noqa: E402

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402


def timed(fn):
    t = time.perf_counter()
    out = fn()
    mx.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=80)
    p.add_argument("--warm", action="store_true", help="call Engine.warm_up first (its cost is reported)")
    p.add_argument("--burst", type=int, default=16, help="rows in the burst-prefill comparison")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    loaded = load_model(args.model)
    engine = Engine(loaded.model, eos_token_ids=[])
    result: dict = {"model": str(args.model), "device": str(mx.default_device())}
    if args.warm:
        _, result["warm_up_s"] = timed(lambda: engine.warm_up(args.max_batch))
    vocab = int(loaded.config.raw.get("vocab_size") or 1000)
    ramp = []
    for b in range(1, args.max_batch + 1):
        prompt = tuple((7 * b + 13 * i) % (vocab - 10) + 5 for i in range(args.prompt))
        engine.open_row(RowSpec(b, prompt, SamplingParams(), 100_000))
        prefill_s = 0.0
        while True:
            progress, dt = timed(lambda: engine.prefill(b))
            prefill_s += dt
            if not progress.remaining:
                break
        _, join_s = timed(lambda: engine.join(b))
        firsts = [timed(engine.step)[1] for _ in range(3)]
        steady = [timed(engine.step)[1] for _ in range(8)]
        ramp.append(
            {
                "B": b,
                "prefill_ms": 1e3 * prefill_s,
                "join_ms": 1e3 * join_s,
                "first_steps_ms": [round(1e3 * x, 2) for x in firsts],
                "steady_ms": round(1e3 * statistics.median(steady), 2),
            }
        )
        print(json.dumps(ramp[-1]), flush=True)
    result["ramp"] = ramp
    # Prefill at new lengths, then the same lengths again (solo rows, closed after prefill).
    lengths = []
    for rep in range(2):
        for n in range(args.prompt - 10, args.prompt + 11, 2):
            rid = 10_000 + 100 * rep + n
            prompt = tuple((3 * n + 11 * i) % (vocab - 10) + 5 for i in range(n))
            engine.open_row(RowSpec(rid, prompt, SamplingParams(), 4))
            _, dt = timed(lambda: engine.prefill(rid))
            engine.close_row(rid)
            lengths.append({"rep": rep, "L": n, "ms": round(1e3 * dt, 2)})
    result["prefill_lengths"] = lengths
    # A burst of N arrivals with new prompt lengths, until every row has its token 0: one prefill
    # and one join per row, vs one Engine.prefill_group + one join_group + one step. Each variant
    # gets lengths neither has seen, so first-time costs count; "_prefill" is the prefill alone.
    burst = {}
    for name, base in (("sequential", 300), ("group", 400), ("sequential_again", 300), ("group_again", 400)):
        ids = [20_000 + 1000 * len(burst) + i for i in range(args.burst)]
        for i, rid in enumerate(ids):
            n = base + 3 * i
            engine.open_row(
                RowSpec(rid, tuple((5 * n + 7 * j) % (vocab - 10) + 5 for j in range(n)), SamplingParams(), 4)
            )
        if name.startswith("group"):
            _, prefill = timed(lambda: engine.prefill_group(ids))
            _, rest = timed(lambda: (engine.join_group(ids), engine.step()))
        else:
            _, prefill = timed(lambda: [engine.prefill(rid) for rid in ids])
            _, rest = timed(lambda: [engine.join(rid) for rid in ids])
        for rid in ids:
            engine.close_row(rid)
        burst[name + "_prefill_ms"] = round(1e3 * prefill, 2)
        burst[name + "_ms"] = round(1e3 * (prefill + rest), 2)
    result["burst"] = {"rows": args.burst, **burst}
    print(json.dumps(result["burst"]), flush=True)
    for rep in range(2):
        ms = [x["ms"] for x in lengths if x["rep"] == rep]
        print(f"prefill rep {rep}: median {statistics.median(ms):.2f} ms, max {max(ms):.2f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
