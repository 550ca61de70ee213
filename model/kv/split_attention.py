"""The parts both decode attention kernels share (model/kv/quant_kernel.py's over a quantized
cache, model/kv/paged_kernel.py's over a paged pool): flash-decoding's split. An attend kernel
writes float32 partials (running max, sum, unnormalized output) per (row, KV head, chunk of the
cache), one warp each; a combine kernel merges a row's chunks in order. Here: the CUDA text of the
attend body's softmax, P @ V and partials, the combine kernel, and the launch of the two.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

WARPS = 4  # warps (chunks) per attend block

# Spliced into both attend kernels' bodies. They use: sc_frag[2][4] (a 16-position tile's
# scores, log2 domain, -inf where masked), m_run / l_run[2] and acc[D / 8][4] (the running max,
# sum and output of the lane's two head rows), vw_s (the warp's 16 x VROW shared V tile),
# lane / g / t, b / h / R / HQ, C / chunk and D.

# Online softmax over the tile's 16 scores (the quad t = 0..3 holds a row's 16), rescaling acc;
# leaves P packed as the A operand of P @ V (pa0..pa3).
ONLINE_SOFTMAX = r"""
        // -- online softmax per head row (the quad t = 0..3 holds a row's 16 scores) --
        float pr[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx_ = fmaxf(fmaxf(sc_frag[0][2 * hh], sc_frag[0][2 * hh + 1]),
                              fmaxf(sc_frag[1][2 * hh], sc_frag[1][2 * hh + 1]));
            mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 1));
            mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 2));
            const float m_new = fmaxf(m_run[hh], mx_);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = exp2f(m_run[hh] - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float pv = exp2f(sc_frag[j][2 * hh + c] - m_use);
                    pr[j][2 * hh + c] = pv;
                    sum += pv;
                }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l_run[hh] = l_run[hh] * alpha + sum;
            m_run[hh] = m_new;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                acc[j][2 * hh] *= alpha;
                acc[j][2 * hh + 1] *= alpha;
            }
        }
        // P as the A operand of P @ V: rows = heads, k = the 16 positions.
        const uint32_t pa0 = kvq_pack<T>(pr[0][0], pr[0][1]);
        const uint32_t pa1 = kvq_pack<T>(pr[0][2], pr[0][3]);
        const uint32_t pa2 = kvq_pack<T>(pr[1][0], pr[1][1]);
        const uint32_t pa3 = kvq_pack<T>(pr[1][2], pr[1][3]);
"""

# acc += P @ V from the shared V tile (which the kernel has filled), then the loop's end.
PV_PRODUCT = r"""
        __syncwarp();
        // -- acc[heads, dims] += P @ V: ldmatrix.trans gives V's B fragments, two dim tiles a time --
#pragma unroll
        for (int j = 0; j < D / 8; j += 2) {
            const int mi = lane >> 3, r = lane & 7;
            const T* src = vw_s + (r + 8 * (mi & 1)) * VROW + 8 * (j + (mi >> 1));
            uint32_t v0, v1, v2, v3;
            kvq_ldmatrix_x4_trans(v0, v1, v2, v3, src);
            qmm_mma<T>(acc[j], pa0, pa1, pa2, pa3, v0, v1);
            qmm_mma<T>(acc[j + 1], pa0, pa1, pa2, pa3, v2, v3);
        }
        __syncwarp();
    }
"""

# The chunk's partials for the combine kernel: running max (log2 domain), sum, unnormalized output.
PARTIALS = r"""
    // -- this chunk's partials: running max (log2 domain), sum, unnormalized output --
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = g + 8 * hh;
        if (r >= R) continue;
        const size_t row = ((size_t)b * HQ + (size_t)h * R + r) * C + chunk;
        if (t == 0) {
            pm[row] = m_run[hh];
            pl[row] = l_run[hh];
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            pacc[row * D + 8 * j + 2 * t] = acc[j][2 * hh];
            pacc[row * D + 8 * j + 2 * t + 1] = acc[j][2 * hh + 1];
        }
    }
"""


# Kernel 2: one block per (row, query head), one thread per dim: the chunks in order.
COMBINE = r"""
    const int C = pm_shape[2];
    const int D = pacc_shape[3];
    const size_t bq = blockIdx.x;
    const int d = threadIdx.x;
    float M = -INFINITY;
    for (int c = 0; c < C; ++c) M = fmaxf(M, pm[bq * C + c]);
    float L = 0.0f, o = 0.0f;
    for (int c = 0; c < C; ++c) {
        const float mc = pm[bq * C + c];
        const float w = mc == -INFINITY ? 0.0f : exp2f(mc - M);
        L += w * pl[bq * C + c];
        o += w * pacc[(bq * C + c) * D + d];
    }
    if (d < D) out[bq * D + d] = static_cast<T>(o / L);
"""

_scales: dict[float, mx.array] = {}


def scale_array(scale: float) -> mx.array:
    """The attention scale as the kernels' float32 [1] input (one array per value)."""
    sc = _scales.get(scale)
    if sc is None:
        sc = _scales[scale] = mx.array([scale], mx.float32)
    return sc


def attend_and_combine(
    attend: Any, combine: Any, inputs: list[mx.array], queries: mx.array, n_kv: int, chunks: int
) -> mx.array:
    """Both decode attention kernels' launch (model/kv/quant_kernel.py's and model/kv/paged_kernel.py's): the
    attend kernel's float32 partials, one warp per (row, KV head, chunk), then the combine of a
    row's chunks in order; [B, Hq, 1, D]."""
    B, n_q, _, D = queries.shape
    pm, pl, pacc = attend(
        inputs=inputs,
        grid=(-(-chunks // WARPS) * 32 * WARPS, B * n_kv, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, n_q, chunks), (B, n_q, chunks), (B, n_q, chunks, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = combine(
        inputs=[pm, pl, pacc],
        grid=(B * n_q * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, n_q, 1, D)],
        output_dtypes=[queries.dtype],
    )
    return out
