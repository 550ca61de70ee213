"""A decode step's packed LoRA delta on CUDA, in two kernels: `z = x @ A` ("shrink") and `y` plus
each row's masked, scaled `z @ B` ("expand").

A decode step's products have few rows (the batch) and the packed ranks are few columns: a GEMM
library tiles `x @ A` into one or two thread blocks that walk all of K alone, and the generic
path adds a mask, a scale, a cast and an add as kernels of their own. Here A is kept transposed
([R, K], model/lora/pack.py), so one thread block reduces one column over all of K with 16-byte
loads and writes it out finished (no split-K partials to add up); columns no row uses are skipped.
The expand kernel gives each thread 8 adjacent output columns for a slice of the ranks and adds
the slices up with warp shuffles, then adds the result to `y` in float32 and rounds once. Every
row's sums run in the same order whatever the other rows are, so a row's delta does not depend
on its batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from model.kernels import cuda_build

MAX_ROWS = 8
MAX_COLUMNS = 1024
_SHRINK_THREADS = 256
_EXPAND_THREADS = 128
_RANK_LANES = 8  # adjacent threads of a warp that split one group of 8 columns' ranks

_HEADER = """
// 8 consecutive elements as floats: 16-byte loads where the address allows, else one by one.
template <typename T>
__device__ inline void load8(const T* p, float* out) {
  if ((reinterpret_cast<unsigned long long>(p) & 15) == 0) {
    if constexpr (sizeof(T) == 4) {
      const float4 lo = *reinterpret_cast<const float4*>(p);
      const float4 hi = *reinterpret_cast<const float4*>(p + 4);
      out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
      out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
      return;
    } else if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = static_cast<float>(v[j]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = static_cast<float>(p[j]);
}
"""

# z[m, r] = sum_k x[m, k] * at[r, k] for the column r of this block (float32, fixed order).
_SHRINK = """
    const int r = blockIdx.x;
    const int t = threadIdx.x;
    constexpr int WARPS = THREADS / 32;
    __shared__ float sums[WARPS][M];
    bool used = false;
    for (int i = 0; i < MASK_ROWS; ++i) used |= static_cast<float>(mask[i * W + r % W]) != 0.0f;
    if (!used) {
        if (t < M) z[t * R + r] = 0.0f;
        return;
    }
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    const auto* row = at + (size_t)r * K;
    for (int k = t * 8; k < K; k += THREADS * 8) {
        float av[8];
        load8(row + k, av);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xv[8];
            load8(x + (size_t)m * K + k, xv);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m] += xv[j] * av[j];
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (t % 32 == 0) sums[t / 32][m] = v;
    }
    __syncthreads();
    if (t < M) {
        float total = 0.0f;
        for (int w = 0; w < WARPS; ++w) total += sums[w][t];
        z[t * R + r] = total;
    }
"""

# out[m, n] = y[m, n] + sum_r (z[m, r] * mask[m, r % W] * scale[m]) * b[r, n], rounded once.
_EXPAND = """
    __shared__ float zs[M][R];
    __shared__ unsigned char live[R];
    for (int i = threadIdx.x; i < M * R; i += blockDim.x) {
        const int m = i / R, r = i % R;
        const int row = MASK_ROWS == 1 ? 0 : m;
        zs[m][r] = z[m * R + r] * static_cast<float>(mask[row * W + r % W]) * static_cast<float>(scale[row]);
    }
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        bool any = false;
        for (int m = 0; m < M; ++m) any |= zs[m][r] != 0.0f;
        live[r] = any;
    }
    __syncthreads();
    const int lane = threadIdx.x % LANES;
    const int n0 = (blockIdx.x * (blockDim.x / LANES) + threadIdx.x / LANES) * 8;
    const bool valid = n0 < N;
    float acc[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][j] = 0.0f;
    if (valid) {
        for (int r = lane; r < R; r += LANES) {
            if (!live[r]) continue;
            float bv[8];
            load8(b + (size_t)r * N + n0, bv);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float zm = zs[m][r];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[m][j] += zm * bv[j];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float v = acc[m][j];
#pragma unroll
            for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[m][j] = v;
        }
    if (!valid) return;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m % LANES != lane) continue;
        float yv[8];
        load8(y + (size_t)m * N + n0, yv);
#pragma unroll
        for (int j = 0; j < 8; ++j) out[(size_t)m * N + n0 + j] = static_cast<TY>(yv[j] + acc[m][j]);
    }
"""

# name -> (inputs, outputs, body); each compiled on first use.
_SOURCES = {
    "shrink": (["x", "at", "mask"], ["z"], _SHRINK),
    "expand": (["z", "b", "y", "mask", "scale"], ["out"], _EXPAND),
}
_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    if name not in _kernels:
        inputs, outputs, source = _SOURCES[name]
        _kernels[name] = cuda_build.kernel(
            name=f"lora_{name}", input_names=inputs, output_names=outputs, source=source, header=_HEADER
        )
    return _kernels[name]


def available() -> bool:
    """Whether the kernels can run: the default device is a CUDA GPU."""
    return mx.cuda.is_available() and mx.default_device().type == mx.gpu


def usable(x: mx.array, at: mx.array, b: mx.array) -> bool:
    """Whether `x`'s delta can take the kernels: on a CUDA GPU, a decode-sized batch, widths of
    whole groups of 8 (A transposed: `at` [R, K], `b` [R, N])."""
    if not available():
        return False
    r, k = at.shape
    return x.size // k <= MAX_ROWS and r <= MAX_COLUMNS and k % 8 == 0 and b.shape[1] % 8 == 0


def times_a(x: mx.array, at: mx.array, mask: mx.array) -> mx.array:
    """`x @ at.T` [rows, R] in float32 for `usable` operands, 0 in the columns `mask` leaves out
    for every row (`mask` [rows or 1, W], R a multiple of W)."""
    r, k = at.shape
    rows = x.size // k
    (z,) = _kernel("shrink")(
        inputs=[x.reshape(rows, k), at, mask],
        template=[
            ("M", rows),
            ("K", k),
            ("R", r),
            ("W", mask.shape[-1]),
            ("MASK_ROWS", mask.shape[0]),
            ("THREADS", _SHRINK_THREADS),
        ],
        grid=(r * _SHRINK_THREADS, 1, 1),
        threadgroup=(_SHRINK_THREADS, 1, 1),
        output_shapes=[(rows, r)],
        output_dtypes=[mx.float32],
    )
    return z


def add_delta(y: mx.array, x: mx.array, at: mx.array, b: mx.array, mask: mx.array, scale: mx.array) -> mx.array:
    """`y` plus every row's packed delta (model/lora/delta.py's expression, in float32 throughout,
    rounded once), for `usable` operands."""
    z = times_a(x, at, mask)
    rows, r = z.shape
    n = b.shape[1]
    groups = -(-n // 8)
    (out,) = _kernel("expand")(
        inputs=[z, b, y.reshape(rows, n), mask, scale],
        template=[
            ("M", rows),
            ("R", r),
            ("N", n),
            ("W", mask.shape[-1]),
            ("MASK_ROWS", mask.shape[0]),
            ("LANES", _RANK_LANES),
            ("TY", y.dtype),
        ],
        grid=(-(-groups * _RANK_LANES // _EXPAND_THREADS) * _EXPAND_THREADS, 1, 1),
        threadgroup=(_EXPAND_THREADS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[y.dtype],
    )
    return out.reshape(y.shape)
