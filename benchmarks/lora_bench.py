"""LoRA decode speed, engine level: B rows decoding together with no adapter, all on one adapter,
and on four different adapters (one per pair of rows), random rank-R adapters on every linear.

    python benchmarks/lora_bench.py --model DIR [--rank 16] [--rows 8] [--steps 128]
        [--variants default,addmm] [--adapter-dtypes model,float32]

Prints tok/s per case and each case against the base-only one (the mixed case's goal: within 25%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import lora_delta  # noqa: E402
from model.engine import Engine  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.params import SamplingParams  # noqa: E402
from model.rows import RowSpec  # noqa: E402
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
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument(
        "--variants",
        default="default",
        help="comma-separated packed-delta variants to time (model/lora_delta.py's A/B switches): "
        "default, addmm, transposed, addmm+transposed, widened, addmm+widened",
    )
    p.add_argument("--adapter-dtypes", default="model", help="comma-separated: model (the base's dtype) and/or float32")
    p.add_argument("--out")
    args = p.parse_args()
    model_dir = Path(args.model)
    loaded = load_model(model_dir)
    model_dtype = {2: "bfloat16", 4: "float32"}.get(loaded.kv_dtype.size, "float32")
    engine = Engine(loaded.model, eos_token_ids=[])
    none = [()] * args.rows
    run(engine, args.rows, none, args.prompt_tokens, 8)  # warm-up: this batch size's shapes
    base = run(engine, args.rows, none, args.prompt_tokens, args.steps)
    results = {"none": base}
    cases = {"one adapter": [("a0",)] * args.rows, "four adapters": [(f"a{i % 4}",) for i in range(args.rows)]}
    with tempfile.TemporaryDirectory() as tmp:
        for adapter_dtype in args.adapter_dtypes.split(","):
            dtype = model_dtype if adapter_dtype == "model" else adapter_dtype
            paths = [
                write_adapter(Path(tmp) / f"{dtype}-a{i}", model_dir, rank=args.rank, seed=i, dtype=dtype)
                for i in range(4)
            ]
            for variant in args.variants.split(","):
                lora_delta.ADDMM = "addmm" in variant
                lora_delta.WIDEN = "widened" in variant
                lora_delta.TRANSPOSED = "transposed" in variant or lora_delta.WIDEN
                for i, path in enumerate(paths):  # (re)packed in this variant's layout
                    if f"a{i}" in {a.id for a in engine.adapters.infos()}:
                        engine.unmount_adapter(f"a{i}")
                    engine.mount_adapter(f"a{i}", str(path))
                for name, choices in cases.items():
                    run(engine, args.rows, choices, args.prompt_tokens, 8)  # warm this case's shapes
                    key = f"{name} [{variant}, {dtype} adapters]"
                    results[key] = run(engine, args.rows, choices, args.prompt_tokens, args.steps)
                    print(f"{key}: {results[key]:.1f} tok/s ({results[key] / base:.2f}x)", flush=True)
        run(engine, args.rows, none, args.prompt_tokens, 8)
        results["none, adapters mounted"] = run(engine, args.rows, none, args.prompt_tokens, args.steps)
    for i in range(4):
        engine.unmount_adapter(f"a{i}")
    results["none, after unmounting"] = run(engine, args.rows, none, args.prompt_tokens, args.steps)
    print(f"device {mx.default_device()}, {args.rows} rows, rank {args.rank}, {args.steps} steps")
    print("| case | tok/s | vs none |")
    print("|---|---|---|")
    for name, tok_s in results.items():
        print(f"| {name} | {tok_s:.1f} | {tok_s / base:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
