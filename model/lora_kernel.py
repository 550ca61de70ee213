"""A decode step's packed LoRA delta on CUDA: `x @ A` as one kernel, and `y` plus the masked,
scaled delta times B as a second one.

The product has few rows (the batch), a long K (the hidden or MLP width) and few columns (the
packed ranks): a GEMM library tiles it into one or two thread blocks that walk all of K alone.
Here every block takes a slice of K for every row and column, so the whole GPU reads A once;
the blocks' partial sums (float32) are then added up by an ordinary reduction. Each row's sum
runs in the same order whatever the other rows are, so a row's delta does not depend on its
batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

MAX_ROWS = 8
MAX_COLUMNS = 1024
_THREADS = 256

_SOURCE = """
    __shared__ float xs[M][CHUNK];
    __shared__ float sums[LANES][M][R];
    const int slice = blockIdx.x;
    const int k0 = slice * CHUNK;
    for (int i = threadIdx.x; i < M * CHUNK; i += blockDim.x) {
        xs[i / CHUNK][i % CHUNK] = static_cast<float>(x[(i / CHUNK) * K + k0 + i % CHUNK]);
    }
    __syncthreads();
    const int column = threadIdx.x % R;
    const int lane = threadIdx.x / R;
    float acc[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    for (int k = lane; k < CHUNK; k += LANES) {
        const float av = static_cast<float>(a[(size_t)(k0 + k) * R + column]);
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] += xs[m][k] * av;
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) sums[lane][m][column] = acc[m];
    __syncthreads();
    if (lane == 0) {
        for (int m = 0; m < M; ++m) {
            float total = 0.0f;
            for (int j = 0; j < LANES; ++j) total += sums[j][m][column];
            partial[((size_t)slice * M + m) * R + column] = total;
        }
    }
"""

# y + every row's delta, the blocks' partial sums of x @ A (`partial`) added up again by each
# block (they are few), masked and scaled, then times B: one thread per output column.
_ADD_SOURCE = """
    __shared__ float z[M][R];
    for (int i = threadIdx.x; i < M * R; i += blockDim.x) {
        const int m = i / R, r = i % R;
        float total = 0.0f;
        for (int s = 0; s < S; ++s) total += partial[((size_t)s * M + m) * R + r];
        const int row = MASK_ROWS == 1 ? 0 : m;
        z[m][r] = total * static_cast<float>(mask[row * W + r % W]) * static_cast<float>(scale[row]);
    }
    __syncthreads();
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float acc[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    for (int r = 0; r < R; ++r) {
        const float bv = static_cast<float>(b[(size_t)r * N + n]);
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] += z[m][r] * bv;
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        out[(size_t)m * N + n] = static_cast<float>(y[(size_t)m * N + n]) + acc[m];
    }
"""

_kernel: Any = None
_add_kernel: Any = None


def _chunk(k: int) -> int:
    """K rows per block: enough blocks to fill the GPU, few enough partial sums to add."""
    for chunk in (64, 128, 256):
        if k % chunk == 0 and k // chunk <= 64:
            return chunk
    return 0


def usable(x: mx.array, a: mx.array) -> bool:
    """Whether `x @ a` can take the kernel: on a CUDA GPU, a decode-sized batch, shapes it tiles."""
    if not mx.cuda.is_available() or mx.default_device().type != mx.gpu:
        return False
    k, r = a.shape
    return x.size // k <= MAX_ROWS and r <= MAX_COLUMNS and _chunk(k) > 0


def _partials(x: mx.array, a: mx.array) -> mx.array:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="lora_times_a", input_names=["x", "a"], output_names=["partial"], source=_SOURCE
        )
    k, r = a.shape
    rows = x.size // k
    chunk = _chunk(k)
    lanes = max(1, _THREADS // r)
    slices = k // chunk
    (partial,) = _kernel(
        inputs=[x.reshape(rows, k), a],
        template=[("M", rows), ("K", k), ("R", r), ("CHUNK", chunk), ("LANES", lanes)],
        grid=(slices * lanes * r, 1, 1),
        threadgroup=(lanes * r, 1, 1),
        output_shapes=[(slices, rows, r)],
        output_dtypes=[mx.float32],
    )
    return partial


def times_a(x: mx.array, a: mx.array) -> mx.array:
    """`x @ a` for `usable` operands, in the dtype `x @ a` has (summed in float32)."""
    out_dtype = x.dtype if x.dtype == a.dtype else mx.float32
    return _partials(x, a).sum(axis=0).astype(out_dtype).reshape(*x.shape[:-1], a.shape[1])


def add_delta(y: mx.array, x: mx.array, a: mx.array, b: mx.array, mask: mx.array, scale: mx.array) -> mx.array:
    """`y` plus every row's packed delta (model/lora_delta.py's expression, in float32 throughout,
    rounded once), for `usable` operands."""
    global _add_kernel
    if _add_kernel is None:
        _add_kernel = mx.fast.cuda_kernel(
            name="lora_add_delta",
            input_names=["partial", "b", "y", "mask", "scale"],
            output_names=["out"],
            source=_ADD_SOURCE,
        )
    partial = _partials(x, a)
    slices, rows, r = partial.shape
    n = b.shape[1]
    (out,) = _add_kernel(
        inputs=[partial, b, y.reshape(rows, n), mask, scale],
        template=[("M", rows), ("R", r), ("N", n), ("S", slices), ("W", mask.shape[-1]), ("MASK_ROWS", mask.shape[0])],
        grid=(-(-n // _THREADS) * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[y.dtype],
    )
    return out.reshape(y.shape)
