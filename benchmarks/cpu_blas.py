"""MLX CPU backend: bundled reference BLAS vs the optimized one model.load.blas preloads.

    python benchmarks/cpu_blas.py                      # bundled vs default search order
    python benchmarks/cpu_blas.py --blas /usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3
    python benchmarks/cpu_blas.py --no-model --seconds 0.5

Each configuration runs in its own subprocess (the BLAS must be preloaded before mlx is
imported, and cannot be unloaded): the setting "off", the default search ("auto"), and one
per `--blas PATH`. Every worker first checks an MLX fp32 matmul against numpy (allclose).
Reports fp32 GFLOP/s for a 1024^3 GEMM, the decode-shaped [1,1024]x[1024,4096] matmul in
both weight layouts (`x @ W` and nn.Linear's `x @ W.T`), [8,1024]x[1024,4096]^T, and, when
tests.fixtures.synth / model.load.loader are importable, prefill and decode tok/s of a small random
float32 model (hidden 512, 4 layers). Timings are best-of-N, since small shared VMs are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GEMMS = [  # (label, M, K, N, transposed weight)
    ("GEMM 1024x1024x1024", 1024, 1024, 1024, False),
    ("GEMV [1,1024]x[1024,4096]", 1, 1024, 4096, False),
    ("GEMV [1,1024]x[4096,1024]^T", 1, 1024, 4096, True),
    ("GEMM [8,1024]x[4096,1024]^T", 8, 1024, 4096, True),
]


# -- worker (runs in a subprocess) -------------------------------------------------------------


def _best_rate(fn, work: float, seconds: float, trials: int = 5) -> float:
    """Best-of-`trials` work/sec, each trial ~seconds/trials long."""
    fn()
    best = 0.0
    per = seconds / trials
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= per and n >= 2:
                break
        best = max(best, work * n / dt)
    return best


def _check_correct(mx, np) -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for m, k, n in [(257, 300, 129), (1, 512, 1000), (64, 64, 64)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k), dtype=np.float32)
        got = np.array(mx.array(a) @ mx.array(b).T)
        ok &= bool(np.allclose(got, a @ b.T, rtol=1e-4, atol=1e-3))
    return ok


def _model_bench(mx, seconds: float, dtype: str) -> dict:
    """Prefill and decode tok/s of a small random model through the real engine."""
    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec
    from model.load.loader import load_model
    from model.options import EngineOptions
    from tests.fixtures.synth import write_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_dir(
            Path(tmp) / "m",
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            dtype=dtype,
            tokenizer_vocab=512,
            vocab_size=4096,
        )
        model = load_model(path).model
    prompt_len, decode_steps = 129, 32
    prompt = tuple(i % 4000 + 1 for i in range(prompt_len))
    engine = Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=prompt_len))
    row = iter(range(1_000_000))

    def prefill() -> int:
        rid = next(row)
        engine.open_row(RowSpec(rid, prompt, SamplingParams(), decode_steps + 1))
        engine.prefill(rid)
        engine.join(rid)
        return rid

    def one_prefill() -> None:
        engine.close_row(prefill())

    prefill_tps = _best_rate(one_prefill, prompt_len - 1, seconds, trials=3)

    def decode() -> float:
        rid = prefill()
        t0 = time.perf_counter()
        produced = 0
        while produced < decode_steps:
            produced += len(engine.step())
        engine.close_row(rid)
        return produced / (time.perf_counter() - t0)

    decode_tps = max(decode() for _ in range(3))
    return {"prefill_tok_s": prefill_tps, "decode_tok_s": decode_tps}


def worker(args) -> None:
    from model.load.blas import preload_optimized_blas

    info = preload_optimized_blas(args.setting)
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    out = {"blas": info.log_line(), "name": info.name, "path": info.path, "correct": _check_correct(mx, np)}
    for label, m, k, n, tr in GEMMS:
        a = mx.random.normal((m, k))
        w = mx.random.normal((n, k) if tr else (k, n))
        mx.eval(a, w)
        b = w.T if tr else w
        out[label] = _best_rate(lambda: mx.eval(a @ b), 2 * m * k * n / 1e9, args.seconds)
    if not args.no_model:
        out.update(_model_bench(mx, args.seconds, args.dtype))
    print("JSON:" + json.dumps(out), flush=True)


# -- driver ------------------------------------------------------------------------------------


def run_config(label: str, setting: str, args) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--setting",
        setting,
        "--seconds",
        str(args.seconds),
        "--dtype",
        args.dtype,
    ] + (["--no-model"] if args.no_model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("JSON:"):
            res = json.loads(line[5:])
            res["label"] = label
            return res
    return {"label": label, "error": (proc.stderr or proc.stdout)[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="auto", help=argparse.SUPPRESS)  # the worker's preload_optimized_blas setting
    ap.add_argument("--blas", action="append", default=[], help="extra library to compare (repeatable)")
    ap.add_argument("--seconds", type=float, default=1.5, help="timing budget per measurement")
    ap.add_argument("--no-model", action="store_true", help="GEMMs only")
    ap.add_argument("--dtype", default="float32", help="model dtype (bf16/fp16 do not use BLAS)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    configs = [("bundled", "off"), ("optimized (default search)", "auto")]
    configs += [(Path(p).name, p) for p in args.blas]
    results = []
    for label, setting in configs:
        r = run_config(label, setting, args)
        results.append(r)
        print(f"# {label}: {r.get('blas', r.get('error'))}", file=sys.stderr, flush=True)

    metrics = [g[0] + " (GFLOP/s)" for g in GEMMS]
    keys = [g[0] for g in GEMMS]
    if not args.no_model:
        metrics += [f"prefill 128 tok/s ({args.dtype}, h512 x4)", "decode tok/s"]
        keys += ["prefill_tok_s", "decode_tok_s"]
    header = ["metric"] + [r["label"] for r in results] + [f"{r['label']} / bundled" for r in results[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    print("| BLAS | " + " | ".join(str(r.get("name", "ERROR")) for r in results) + " |" + " |" * (len(results) - 1))
    print(
        "| matmul == numpy | "
        + " | ".join(str(r.get("correct", "-")) for r in results)
        + " |"
        + " |" * (len(results) - 1)
    )
    for metric, key in zip(metrics, keys):
        vals = [r.get(key) for r in results]
        cells = [f"{v:.1f}" if isinstance(v, (int, float)) else "-" for v in vals]
        ratios = [
            f"{v / vals[0]:.1f}x"
            if isinstance(v, (int, float)) and isinstance(vals[0], (int, float)) and vals[0]
            else "-"
            for v in vals[1:]
        ]
        print(f"| {metric} | " + " | ".join(cells + ratios) + " |")
    for r in results:
        if "model_error" in r:
            print(f"\nmodel benchmark ({r['label']}): {r['model_error']}")
        if "error" in r:
            print(f"\n{r['label']} failed: {r['error']}")
    if any(r.get("correct") is False for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
