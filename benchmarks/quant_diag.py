"""What the quantized-matmul kernel does on this GPU, in under a minute, at the Llama-3-8B q4
shapes: per weight shape and row count (1, 8, 32), MLX's `quantized_matmul` against our kernel
(model/quant_kernel.py) and a bf16 matmul of the same shape, and which of the two the server's
routing picks after the measurement it makes at load (model/quant_tune.py `tune`, then
`quant_kernel.usable` on a decode step's [rows, 1, K] activations).

Two timings per product: "queued" (20 calls evaluated together, over copies of the weight that
overflow L2: what a compiled decode step pays, and what tune measures) and "sync" (one call per
evaluation: launch and host round trip included). "first" is a kernel's first call at a row
count: its NVRTC compile (ours; MLX's CUTLASS kernels compile too) plus one run.
Every line prints as soon as it is known; a kernel that fails to compile or run prints its
exception and the rest goes on. Ends with the products of one 8B decode step (32 layers and the
LM head) added up per row count: MLX's op, ours, whatever the routing picks, bf16.

    python benchmarks/quant_diag.py [--budget 50] [--bits 4] [--group-size 64] [--rows 1,8,32]

A row count past 64 (a prefill chunk, e.g. --rows 1,8,32,2048) times MLX's op against
dequantizing the weight and running the bf16 GEMM instead.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_micro import timed as sync_time  # noqa: E402  (one synchronized call at a time)
from model import quant_kernel, quant_tune  # noqa: E402

# (name, N, K, products per 8B decode step: 32 layers, the LM head once)
SHAPES = [
    ("q/o", 4096, 4096, 64),
    ("gate/up", 14336, 4096, 64),
    ("down", 4096, 14336, 32),
    ("k/v", 1024, 4096, 64),
    ("lm_head", 128256, 4096, 1),
]


def say(text: str) -> None:
    print(text, flush=True)


def first_call(fn: Callable[[], mx.array]) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e6 * seconds:.1f}us"


def failure(e: BaseException) -> str:
    tb = traceback.format_exception_only(type(e), e)
    return " ".join(line.strip() for line in tb)[:600]


def routing(x: mx.array, q: mx.array, s: mx.array, b: mx.array, bits: int, gs: int, tuned: dict) -> str:
    """Which op the server's KernelQuantizedLinear runs for a decode step of x's rows, and why."""
    rows = quant_kernel.rows_of(x)
    if not quant_kernel.available():
        return "MLX (no CUDA GPU: the kernels are off)"
    if rows < 2:
        return "MLX (one row: MLX's op by design)"
    if quant_kernel.usable(x, q, s, b, bits, gs):
        return "KERNEL"
    if "failed" in tuned:
        return f"MLX (tune failed: {str(tuned['failed'])[:300]})"
    per = tuned.get("rows", {}).get(rows)
    if per is not None:
        return f"MLX (tune measured ours {us(per['ours'])} vs MLX {us(per['mlx'])})"
    if quant_kernel.config_for(q.shape[0], x.shape[-1], bits) is None:
        return "MLX (the shape does not tile)"
    return "MLX (slower at the nearest measured row count)"


def shape(name: str, n: int, k: int, per_step: int, args: argparse.Namespace, step: dict) -> bool:
    """Measure one weight shape at every row count and add its products to `step`; False if
    anything failed (the step totals are then incomplete)."""
    bits, gs, dtype, ok = args.bits, args.group_size, mx.bfloat16, True
    key = mx.random.key(n + k)
    w = (mx.random.normal((n, k), key=key) * 0.02).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(w, q, s, b)
    cfg = quant_kernel.config_for(n, k, bits)
    say(f"{name} {n}x{k} q{bits} g{gs}: tiling {cfg} ({(q.nbytes + s.nbytes + b.nbytes) / 1e6:.1f} MB)")
    queue = quant_tune._queue(n * k)
    copies = quant_tune._copies(q, s, b)  # (timed in turn: device memory, not L2)
    timed: dict[int, tuple[float, float, float | None]] = {}
    for m in args.rows_list:
        x2 = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
        try:
            mlx = partial_mlx(x2, q, s, b, gs, bits)
            first_mlx = first_call(mlx)
            t_mlx, s_mlx = quant_tune._time(rotating_mlx(x2, copies, gs, bits), queue=queue), sync_time(mlx)
            # a decode step's [B, 1, K] as it reached MLX's op before `quant_linear.as_rows`
            t_bf16 = quant_tune._time(lambda: x2 @ w.T, queue=queue)
            if m > quant_kernel.MAX_ROWS:  # a prefill chunk: MLX's op against dequantize + the bf16 GEMM
                deq = quant_tune._rotating(
                    lambda x, q_, s_, b_: x @ mx.dequantize(q_, s_, b_, group_size=gs, bits=bits).T, copies, x2
                )
                t_deq = quant_tune._time(deq, queue=queue)
                say(
                    f"  M={m}: mlx {us(t_mlx)} (first call {first_mlx:.2f}s) | dequantize + bf16 GEMM {us(t_deq)} "
                    f"| bf16 {us(t_bf16)}"
                )
                continue
            t_batch = quant_tune._time(rotating_mlx(x2[:, None], copies, gs, bits), queue=queue) if m > 1 else t_mlx
            say(
                f"  M={m}: mlx {us(t_mlx)} (sync {us(s_mlx)}, first call {first_mlx:.2f}s) | mlx as [{m},1,K] "
                f"{us(t_batch)} | bf16 {us(t_bf16)}"
            )
        except Exception as e:  # noqa: BLE001
            say(f"  M={m}: MLX's op failed: {failure(e)}")
            ok = False
            continue
        t_ours = None
        try:  # (a line that never comes: our kernel hung here)
            ours = lambda: quant_kernel.qmm(x2, q, s, b, bits)  # noqa: E731
            first = first_call(ours)
            err = quant_tune._rel_err(ours(), mlx())
            rot = quant_tune._rotating(lambda x, w_, s_, b_: quant_kernel.qmm(x, w_, s_, b_, bits), copies, x2)
            t_ours, s_ours = quant_tune._time(rot, queue=queue), sync_time(ours)
            say(
                f"  M={m}: ours {us(t_ours)} (sync {us(s_ours)}, first call {first:.2f}s, rel err {err:.2g}) "
                f"| ours/mlx {t_ours / t_mlx:.2f}x"
            )
        except Exception as e:  # noqa: BLE001
            say(f"  M={m}: ours FAILED: {failure(e)}")
            ok = False
        timed[m] = (t_mlx, t_bf16, t_ours)
    t0 = time.perf_counter()
    try:  # the server's measurement at load (model/quant_linear.py route), at these row counts
        decode_rows = tuple(m for m in args.rows_list if 2 <= m <= quant_kernel.MAX_ROWS)
        report = quant_tune.tune([(n, k, bits, gs, dtype)], rows=decode_rows)
        tuned = next(iter(report.values()), {})
    except Exception as e:  # noqa: BLE001
        tuned = {"failed": failure(e)}
    picks = []
    for m, (t_mlx, t_bf16, t_ours) in timed.items():
        try:
            pick = routing(mx.zeros((m, 1, k), dtype), q, s, b, bits, gs, tuned)  # a decode step's activations
        except Exception as e:  # noqa: BLE001
            pick = f"? ({failure(e)})"
        picks.append(f"M={m} {pick}")
        acc = step[m]
        acc["mlx"] += per_step * t_mlx
        acc["bf16"] += per_step * t_bf16
        acc["ours"] += per_step * (t_ours if t_ours is not None else float("nan"))
        acc["routed"] += per_step * (t_ours if pick == "KERNEL" and t_ours is not None else t_mlx)
    say(f"  routing after tune ({time.perf_counter() - t0:.1f}s): " + "; ".join(picks))
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=50.0, help="seconds; shapes not started by then are skipped")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", default="1,8,32")
    names = [name for name, *_ in SHAPES]
    p.add_argument("--shapes", default=",".join(names), help="which of " + ", ".join(names))
    args = p.parse_args()
    args.rows_list = [int(r) for r in args.rows.split(",")]
    t_start = time.perf_counter()
    say(f"mlx {mx.__version__}; device {mx.default_device()}; cuda {mx.cuda.is_available()}")
    try:
        say(f"device_info {mx.device_info()}")
    except Exception as e:  # noqa: BLE001
        say(f"device_info failed: {failure(e)}")
    say(f"kernels available {quant_kernel.available()}; clusters {quant_kernel.clusters()}")
    step = {m: dict.fromkeys(("mlx", "ours", "routed", "bf16"), 0.0) for m in args.rows_list}
    wanted = args.shapes.split(",")
    complete = set(wanted) >= set(names)
    for name, n, k, per_step in SHAPES:
        if name not in wanted:
            continue
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget:
            say(f"{name} {n}x{k}: skipped (past the {args.budget:.0f} s budget at {elapsed:.0f} s)")
            complete = False
            continue
        try:
            complete = shape(name, n, k, per_step, args, step) and complete
        except Exception as e:  # noqa: BLE001
            say(f"{name} {n}x{k}: failed: {failure(e)}")
            complete = False
    if complete:
        for m, acc in step.items():
            if m > quant_kernel.MAX_ROWS:
                continue
            say(
                f"8B decode step products at M={m} (queued): mlx {1e3 * acc['mlx']:.2f} ms, ours "
                f"{1e3 * acc['ours']:.2f} ms, as routed {1e3 * acc['routed']:.2f} ms, bf16 {1e3 * acc['bf16']:.2f} ms"
            )
    say(f"done in {time.perf_counter() - t_start:.1f}s; kernels compiled {len(quant_kernel._kernels)}")


def rotating_mlx(x: mx.array, copies: list, gs: int, bits: int) -> Callable[[], mx.array]:
    return quant_tune._rotating(mx.quantized_matmul, copies, x, transpose=True, group_size=gs, bits=bits)


def partial_mlx(x: mx.array, q: mx.array, s: mx.array, b: mx.array, gs: int, bits: int) -> Callable[[], mx.array]:
    return lambda: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)


if __name__ == "__main__":
    main()
