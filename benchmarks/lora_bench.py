"""LoRA decode speed, engine level: B rows decoding together with no adapter, all on one adapter,
and on four different adapters (one per pair of rows), random rank-R adapters on every linear.

    python benchmarks/lora_bench.py --model DIR [--rank 16] [--num-layers -1] [--rows 8] [--steps 128] [--rounds 3]
        [--adapter-dtypes model,float32]

Each round measures the base with no adapter mounted, then mounts the adapters and measures base
rows, one adapter and four; rounds interleave so a drifting device hits every case alike. Prints
the median tok/s per case against the base-only one (the mixed case's goal: within 25%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from tests.fixtures.lora import write_adapter  # noqa: E402


def run(engine: Engine, rows: int, choices: list[tuple[str, ...]], prompt_tokens: int, steps: int) -> float:
    specs = [
        RowSpec(
            i,
            tuple(3 + (i * 31 + j * 7) % 1000 for j in range(prompt_tokens)),
            SamplingParams(),
            steps + 8,
            adapters=choices[i],
        )
        for i in range(rows)
    ]
    for s in specs:
        engine.open_row(s)
        while engine.prefill(s.row_id).remaining:
            pass
    engine.join_group([s.row_id for s in specs])
    for _ in range(4):  # the first steps: token 0s, graph set-up
        engine.step()
    mx.synchronize()
    started, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(engine.step())
    mx.synchronize()
    seconds = time.perf_counter() - started
    for s in specs:
        engine.close_row(s.row_id)
    return tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=-1, help="adapt the last N blocks (-1: all; mlx_lm.lora: 16)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="measure none / one / four this many times, interleaved")
    p.add_argument("--adapter-dtypes", default="model", help="comma-separated: model (the base's dtype) and/or float32")
    p.add_argument("--out")
    args = p.parse_args()
    model_dir = Path(args.model)
    loaded = load_model(model_dir)
    model_dtype = {2: "bfloat16", 4: "float32"}.get(loaded.kv_dtype.size, "float32")
    engine = Engine(loaded.model, eos_token_ids=[])
    none: list[tuple[str, ...]] = [()] * args.rows
    run(engine, args.rows, none, args.prompt_tokens, 8)  # warm-up: this batch size's shapes
    cases: dict[str, list[tuple[str, ...]]] = {
        "one adapter": [("a0",)] * args.rows,
        "four adapters": [(f"a{i % 4}",) for i in range(args.rows)],
    }
    samples: dict[str, list[float]] = {}

    def measure(key: str, choices: list[tuple[str, ...]]) -> None:
        samples.setdefault(key, []).append(run(engine, args.rows, choices, args.prompt_tokens, args.steps))
        print(f"{key}: {samples[key][-1]:.1f} tok/s", flush=True)

    def remount(paths: list[Path]) -> None:  # (a new version: the compiled decode traces afresh)
        for info in engine.adapters.infos():
            engine.unmount_adapter(info.id)
        for i, path in enumerate(paths):
            engine.mount_adapter(f"a{i}", str(path))

    with tempfile.TemporaryDirectory() as tmp:
        for adapter_dtype in args.adapter_dtypes.split(","):
            dtype = model_dtype if adapter_dtype == "model" else adapter_dtype
            paths = [
                write_adapter(
                    Path(tmp) / f"{dtype}-a{i}",
                    model_dir,
                    rank=args.rank,
                    seed=i,
                    dtype=dtype,
                    num_layers=args.num_layers,
                )
                for i in range(4)
            ]
            remount(paths)  # warm every case's shapes once
            for choices in cases.values():
                run(engine, args.rows, choices, args.prompt_tokens, 8)
            # Interleaved rounds, slow drifts of the device hitting every case alike; the base-only
            # reference with no adapter mounted in each round.
            for _ in range(args.rounds):
                remount([])
                measure("none", none)
                remount(paths)
                measure("none, adapters mounted", none)
                for name, choices in cases.items():
                    measure(f"{name} [{dtype} adapters]", choices)
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["none"]
    layers = "all" if args.num_layers <= 0 else f"last {args.num_layers}"
    print(f"device {mx.default_device()}, {args.rows} rows, rank {args.rank} on {layers} blocks, {args.steps} steps")
    print("| case | tok/s | vs none |")
    print("|---|---|---|")
    for name, tok_s in results.items():
        print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
