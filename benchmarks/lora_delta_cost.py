"""What the packed LoRA deltas of one decode step cost on their own, per variant: 32 layers of an
8B shape (q/k/v and gate/up fused, o and down alone), B rows, R packed columns, compiled as the
decode is; against the base products of the same step.

    python benchmarks/lora_delta_cost.py [--rows 8] [--width 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import lora_delta  # noqa: E402
from model.lora_delta import RowMask, add_packed_delta  # noqa: E402

# (in, out, fused members) of each product of a Llama-3-8B layer
PRODUCTS = [(4096, 6144, 3), (4096, 4096, 1), (4096, 28672, 2), (14336, 4096, 1)]


def timed(fn, *args, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(*args))
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    dt, rows, width = mx.bfloat16, args.rows, args.width
    key = iter(mx.random.split(mx.random.key(0), 1000))
    weights = [[mx.random.normal((n_out, n_in), key=next(key)).astype(dt) for n_in, n_out, _ in PRODUCTS]]
    weights *= args.layers  # (the same base arrays per layer: the deltas are what is timed)
    xs = [mx.random.normal((rows, 1, n_in), key=next(key)).astype(dt) for n_in, _, _ in PRODUCTS]
    mask = RowMask(mx.ones((rows, width), dt), mx.ones((rows, 1), dt))
    print(f"device {mx.default_device()}, {rows} rows, R={width}, {args.layers} layers")

    def base(ws, xs):
        return [x @ w.T for layer in ws for x, w in zip(xs, layer, strict=True)]

    print(f"base products: {timed(mx.compile(base), weights[:1] * args.layers, xs):.2f} ms")
    for variant in ("default", "addmm", "transposed", "addmm+transposed"):
        lora_delta.ADDMM, lora_delta.TRANSPOSED = "addmm" in variant, "transposed" in variant
        packed = []
        for _ in range(args.layers):
            layer = []
            for n_in, n_out, g in PRODUCTS:
                a = mx.random.normal((n_in, g * width), key=next(key)).astype(dt) * 0.01
                b = mx.random.normal((g * width, n_out), key=next(key)).astype(dt) * 0.01
                layer.append((mx.contiguous(a.T), mx.contiguous(b.T)) if lora_delta.TRANSPOSED else (a, b))
            packed.append(layer)
        mx.eval(packed)
        ys = [mx.zeros((rows, 1, n_out), dt) for _, n_out, _ in PRODUCTS]

        def deltas(packed, xs, ys, m, s):
            rm = RowMask(m, s)
            return [add_packed_delta(y, x, a, b, rm) for layer in packed for x, y, (a, b) in zip(xs, ys, layer)]

        ms = timed(mx.compile(deltas), packed, xs, ys, mask.mask, mask.scale)
        print(f"deltas [{variant}]: {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
