"""SwiGLU on MLX's CPU backend, bit for bit MLX's own, in about two thirds of the time.

MLX's x86 CPU build evaluates `exp` (and so `sigmoid`, and `nn.silu`) one element at a time with
a Cephes polynomial whose six steps are `std::fma` calls (mlx/backend/cpu/simd/math.h; without
`-mfma` each is a libm call): ~12 ns per float32, 25x a multiply. In a `cpu-small` prefill the
MLP's `silu(gate) * up` was a third of each layer's time.

`swiglu` below computes the same polynomial with ordinary MLX ops fused by `mx.compile`. Each
fused multiply-add is done in float64 — the product of two float32 values is exact there, and
the one rounding of the sum to 53 bits then to 24 agreed with the single-rounded `fma` on every
input we tried (tests/test_cpu_exact.py compares against `mx.sigmoid` across the whole float32
range, infinities and NaN included). The sigmoid around it is MLX's CPU formula
(mlx/backend/cpu/unary_ops.h: `y = 1 / (1 + exp(|x|))`, then `x < 0 ? y : 1 - y`). So greedy
tokens stay mlx-lm's. Float32 on the CPU only: elsewhere `nn.silu` is the definition.

Not shape-agnostic (`mx.compile(shapeless=True)` cannot trace the bit cast), so each new input
shape is traced once, ~1 ms; the fused C++ kernels are shared by every shape.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np

# Cephes exp2 polynomial on [-0.5, 0.5], highest degree first, as MLX's CPU `simd::exp` has it.
_EXP2_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


# The same constants, widened exactly to float64 (their float32 values, as the C++ has them).
_EXP2_POLY_F64 = tuple(float(np.float32(c)) for c in _EXP2_POLY)


def exp_f32(x: mx.array, *, non_negative: bool = False) -> mx.array:
    """MLX's float32 CPU `exp`, op for op (2**round(y) by bit shift times a polynomial in the
    rest). `non_negative` (x >= 0 or NaN) drops the steps that cannot apply then."""
    y = x * 1.442695  # log2(e), rounded to float32 as in MLX
    whole = mx.floor(y + 0.5)
    frac = (y - whole).astype(mx.float64)
    p = mx.array(_EXP2_POLY[0], mx.float32)
    for c in _EXP2_POLY_F64[1:]:
        p = (p.astype(mx.float64) * frac + mx.array(c, mx.float64)).astype(mx.float32)
    out = ((whole.astype(mx.int32) + 127) << 23).view(mx.float32) * p
    if not non_negative:
        out = mx.where(mx.isnan(x), x, out)  # (a NaN x already gives a NaN p)
        out = mx.where(x < -88.0, mx.array(0.0, mx.float32), out)
    return mx.where(x > 88.0, mx.array(mx.inf, mx.float32), out)


def sigmoid_f32(x: mx.array) -> mx.array:
    y = 1.0 / (1.0 + exp_f32(mx.abs(x), non_negative=True))
    return mx.where(x < 0, y, 1.0 - y)


@mx.compile
def swiglu_f32(gate: mx.array, x: mx.array) -> mx.array:
    """`nn.silu(gate) * x` (mlx-lm's swiglu) for float32 on the CPU, bit-identical."""
    return (gate * sigmoid_f32(gate)) * x


# Elements per fused call. Past a few hundred thousand floats one call of the fused kernel slowed
# from ~11 to 20-30 ns per element (cpu-small MLP, 2030 x 768 gate: 45 ms whole, 23 ms in
# 64K-element pieces), so a prefill's gate is run in row blocks of about this size.
PIECE_ELEMENTS = 1 << 16


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`swiglu_f32`, in row blocks of about PIECE_ELEMENTS when the input is large: each
    element's result is the same either way (it depends on that element alone)."""
    width = gate.shape[-1]
    rows = gate.size // width
    step = max(1, PIECE_ELEMENTS // width)
    if PIECE_ELEMENTS <= 0 or rows <= 2 * step:
        return swiglu_f32(gate, x)
    g, u = gate.reshape(rows, width), x.reshape(rows, width)
    pieces = [swiglu_f32(g[i : i + step], u[i : i + step]) for i in range(0, rows, step)]
    return mx.concatenate(pieces).reshape(gate.shape)


# MLX fuses a compiled CPU graph into C++ it builds with `g++` at run time; without one it runs
# the ops one by one, and this formula is then slower than `mx.sigmoid` (3.9 vs 3.3 ms for a
# 250 x 768 gate, 2.0 vs 3.2 ms with g++).
ENABLED = shutil.which("g++") is not None


def applies(gate: mx.array, x: mx.array) -> bool:
    return ENABLED and gate.dtype == mx.float32 and x.dtype == mx.float32 and mx.default_device().type == mx.cpu
