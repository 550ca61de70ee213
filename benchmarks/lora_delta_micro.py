"""The packed LoRA deltas' own cost in a decode-like chain (GPU): the 8B shape's four products per
layer (fused q/k/v, o, fused gate/up, down) over L layers, compiled, 8 rows, with no delta and with
the generic products and with the shipped path (the CUDA kernels where they run), for one adapter
and for four (A stored as packing stores it here).

    python benchmarks/lora_delta_micro.py [--layers 32] [--rank 16] [--iters 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.lora.delta import LORA_AT, LORA_B, RowMask, a_key, packed_delta, with_delta  # noqa: E402

HIDDEN, Q, KV, INTER, ROWS = 4096, 4096, 1024, 14336, 8


def block_diag(parts: list[mx.array]) -> mx.array:
    rows = sum(p.shape[0] for p in parts)
    cols = sum(p.shape[1] for p in parts)
    out = mx.zeros((rows, cols), parts[0].dtype)
    r = c = 0
    for p in parts:
        out[r : r + p.shape[0], c : c + p.shape[1]] = p
        r, c = r + p.shape[0], c + p.shape[1]
    return out


def weights(layers: int, width: int) -> list[dict[str, mx.array]]:
    def rnd(*shape: int) -> mx.array:
        return (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)

    out = []
    for _ in range(layers):
        w = {"qkv": rnd(Q + 2 * KV, HIDDEN), "o": rnd(HIDDEN, Q), "gu": rnd(2 * INTER, HIDDEN), "d": rnd(HIDDEN, INTER)}
        if width:
            w |= {
                "qkv_a": rnd(HIDDEN, 3 * width),  # (renamed below to packing's key and layout)
                "qkv_b": block_diag([rnd(width, Q), rnd(width, KV), rnd(width, KV)]),
                "o_a": rnd(Q, width),
                "o_b": rnd(width, HIDDEN),
                "gu_a": rnd(HIDDEN, 2 * width),
                "gu_b": block_diag([rnd(width, INTER), rnd(width, INTER)]),
                "d_a": rnd(INTER, width),
                "d_b": rnd(width, HIDDEN),
            }
        for key in ("qkv", "o", "gu", "d") if width else ():
            a = w.pop(key + "_a")
            w[key + a_key()] = mx.contiguous(a.T) if a_key() == LORA_AT else a
            w[key + LORA_B] = w.pop(key + "_b")
        out.append(w)
    mx.eval(out)
    return out


def chain(
    layers: list[dict[str, mx.array]], x: mx.array, mask: mx.array | None, scale: mx.array | None, mode: str = ""
) -> mx.array:
    rows = None if mask is None or scale is None else RowMask(mask, scale)

    def product(w: dict[str, mx.array], key: str, h: mx.array) -> mx.array:
        y = h @ w[key].T
        if rows is None:
            return y
        if mode == "matmul":  # the generic products, on the layout packing stores here
            at = w.get(key + LORA_AT)
            a = at if at is not None else w[key + a_key()]
            return y + packed_delta(h, a, w[key + LORA_B], rows, transposed=at is not None)
        return with_delta(y, h, w, key, rows)  # type: ignore[arg-type]  # (a dict stands in for the module)

    for w in layers:
        h = x * mx.rsqrt(mx.mean(x.astype(mx.float32) ** 2, axis=-1, keepdims=True) + 1e-5).astype(x.dtype)
        y = product(w, "qkv", h)
        x = x + product(w, "o", y[:, :Q])
        h = x * mx.rsqrt(mx.mean(x.astype(mx.float32) ** 2, axis=-1, keepdims=True) + 1e-5).astype(x.dtype)
        y = product(w, "gu", h)
        x = x + product(w, "d", y[:, :INTER] * y[:, INTER:])
    return x


def timed(fn, *args: mx.array, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        mx.eval(fn(*args))
    mx.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(*args))
    mx.synchronize()
    return (time.perf_counter() - started) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--modes", default="matmul,shipped", help="matmul: the generic products; shipped: with_delta")
    args = p.parse_args()
    x = mx.random.normal((ROWS, HIDDEN)).astype(mx.bfloat16)
    for adapters in (1, 4):
        width = args.rank * adapters
        layers = weights(args.layers, width)
        base = timed(mx.compile(partial(chain, layers, mask=None, scale=None)), x, iters=args.iters)
        print(f"{adapters} adapter(s) packed, {args.layers} layers: base only {base:.2f} ms/step", flush=True)
        mask = mx.zeros((ROWS, width), mx.bfloat16)
        for i in range(ROWS):
            j = i % adapters
            mask[i, j * args.rank : (j + 1) * args.rank] = 1
        scale = mx.full((ROWS, 1), 2.0, mx.bfloat16)
        reference = None
        for mode in args.modes.split(","):
            fn = mx.compile(partial(chain, layers, mode=mode))
            ms = timed(fn, x, mask, scale, iters=args.iters)
            out = fn(x, mask, scale).astype(mx.float32)
            if reference is None:
                reference = out
            drift = (mx.abs(out - reference).max() / (mx.abs(reference).max() + 1e-6)).item()
            print(
                f"  {mode}: {ms:.2f} ms/step, deltas {ms - base:.2f} ms, {base / ms:.2f}x of base; "
                f"output vs {args.modes.split(',')[0]}: max rel diff {drift:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
