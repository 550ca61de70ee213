"""KV bytes per row and the max safe context for --kv-quant off / 8 / 4 on one model dir.

Engine level, in process: for each scheme one row of --tokens prompt tokens is prefilled, joined
and stepped; its caches' bytes are what a row holds (the buffers' 256-slot capacity included).
The max safe context is admission's (actors/policy.py) for this device's default budget, not
capped at the model's context window (the cap is printed alongside). Prints a markdown table
and writes JSON with --out.

    python benchmarks/kv_quant_bytes.py --model DIR --tokens 16384
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

from actors.policy import admission_ceiling, device_memory, memory_budget_bytes  # noqa: E402
from actors.worker_api import kv_fields  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.kv import scheme as kv_scheme  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import KVOptions  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--modes", default="off,8,4")
    p.add_argument("--out")
    args = p.parse_args()
    loaded = load_model(args.model)
    model = loaded.model
    layers = len(model.layers)
    device = mx.default_device().type.name
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    budget = memory_budget_bytes(None, device_memory_bytes=device_memory(device, info, ram_bytes=0))
    prompt = tuple(3 + (i * 7919) % 1000 for i in range(args.tokens))
    rows = []
    for mode in args.modes.split(","):
        scheme = kv_scheme.resolve(KVOptions(kv_quant=mode), model_dir=Path(args.model), num_layers=layers)
        engine = Engine(model, eos_token_ids=[], kv_scheme=scheme)
        fields = kv_fields(
            scheme,
            num_layers=layers,
            dtype_name=str(loaded.kv_dtype),
            dtype_bytes=loaded.kv_dtype.size,
            prefill_chunk=engine.options.prefill_chunk,
        )
        t0 = time.perf_counter()
        engine.open_row(RowSpec(0, prompt, SamplingParams(), 8))
        while engine.prefill(0).remaining:
            pass
        engine.join(0)
        engine.step()
        engine.step()
        mx.synchronize()
        seconds = time.perf_counter() - t0
        row_bytes = sum(c.nbytes for c in engine._caches)
        engine.close_row(0)
        ceiling = admission_ceiling(
            budget_bytes=budget,
            weights_bytes=loaded.weights_bytes,
            kv_bytes_per_token=loaded.kv_bytes_per_token,
            context_length=10**9,
            kv_quant_ratio=fields["kv_quant_ratio"],
            kv_quantized_from=fields["kv_quantized_from"],
        )
        rows.append(
            {
                "mode": mode,
                "label": scheme.label,
                "tokens": args.tokens,
                "row_kv_bytes": row_bytes,
                "bytes_per_token": row_bytes / args.tokens,
                "ratio_vs_full": fields["kv_quant_ratio"],
                "max_safe_context": ceiling.max_safe_context,
                "prefill_s": round(seconds, 2),
            }
        )
        del engine
        mx.clear_cache()
    print(
        f"device {device} {info.get('device_name', '')}, budget {budget / 1e9:.1f} GB, weights "
        f"{loaded.weights_bytes / 1e9:.2f} GB, context window {loaded.config.max_position_embeddings}"
    )
    print("| kv | KV bytes/row at", args.tokens, "| bytes/token | vs off | max safe context | prefill+2 steps s |")
    print("|---|---|---|---|---|---|")
    base = rows[0]["row_kv_bytes"]
    for r in rows:
        print(
            f"| {r['label']} | {r['row_kv_bytes'] / 2**20:.0f} MiB | {r['bytes_per_token']:.0f} | "
            f"{r['row_kv_bytes'] / base:.3f} | {r['max_safe_context']} | {r['prefill_s']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
