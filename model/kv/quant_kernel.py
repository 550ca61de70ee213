"""Decode attention over a quantized KV cache on CUDA, without dequantizing the cache: one fused
kernel reads the 4/8-bit keys and values with their scales and biases (model/kv/quant.py's
triples, `mx.quantize` layout along the head dimension), and a second adds up its chunks.

Flash-decoding, split along the positions: each warp owns a chunk of `CHUNK` positions of one
(row, KV head) and all the query heads of its group (GQA), 16 positions at a time:

* scores: the group's queries (up to 16 heads, head_dim 128) are the A operand of `mma.sync`
  m16n8k16, kept in registers for the whole chunk; keys are the B operand, dequantized in
  registers from one 16-byte load per lane and position (4-bit; two for 8-bit), in the same
  permuted k order as model/quant_kernel.py (the queries read through that permutation);
* an online softmax in float32 (exp2, scores scaled by scale * log2 e), masked outside
  [left padding, length);
* values: dequantized by the warp into shared memory (bf16/f16), then `ldmatrix.trans` gives the
  B operand of P @ V, P coming straight from the score fragments.

Each chunk writes its running max, sum and unnormalized output (float32); the second kernel
combines a (row, head)'s chunks in order. Chunks start at the row's first position and their size
does not depend on the batch, so a row's output does not depend on the rows decoding with it (nor
on its left padding). Everything else (prefill, head_dim other
than 128, more than 16 query heads per KV head, Metal, CPU) keeps model/kv/quant.py's path.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from model import quant_kernel
from model.kernels import cuda_build
from model.kernels.qmm_cuda import HEADER
from model.kv import split_attention

log = logging.getLogger(__name__)

HEAD_DIM = 128
MAX_GROUP = 16
CHUNK = 256  # positions per warp: the split along the cache (independent of the batch)

_HEADER = (
    HEADER
    + r"""
QMM_DEVICE void kvq_ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

template <typename T>
QMM_DEVICE uint32_t kvq_pack(float lo, float hi) {
  return cuda::std::is_same_v<T, __nv_bfloat16> ? qmm_pack_bf16(lo, hi) : qmm_pack_f16(lo, hi);
}

template <typename T>
QMM_DEVICE uint32_t kvq_pair(const T* p) {  // two consecutive elements as one register
  return *reinterpret_cast<const uint32_t*>(p);
}

// The (scale, scale) and (bias, bias) registers of group `gi` of a quantized row.
template <typename T>
QMM_DEVICE void kvq_group(const T* s, const T* b, int gi, uint32_t& s2, uint32_t& b2) {
  const T sv = s[gi], bv = b[gi];
  const uint16_t su = *reinterpret_cast<const uint16_t*>(&sv), bu = *reinterpret_cast<const uint16_t*>(&bv);
  s2 = (uint32_t)su | ((uint32_t)su << 16);
  b2 = (uint32_t)bu | ((uint32_t)bu << 16);
}
"""
)

# Kernel 1: one warp per (row, KV head, chunk). Constants from `_source`: T, BITS, R (query heads
# per KV head), CHUNK, WARPS.
_ATTEND = (
    r"""
    constexpr int D = 128;
    constexpr int KSTEPS = D / 16;               // 8 mma k steps over the head dimension
    constexpr int LW = D / 4 * BITS / 32;        // packed words of a lane's 32 dims (4 or 8)
    constexpr int VROW = D + 8;                  // shared V row stride, in elements (272 bytes)
    constexpr float LOG2E = 1.4426950408889634f;

    __shared__ __align__(16) T vsm[WARPS][16 * VROW];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int HQ = q_shape[1], HKV = kw_shape[1], TT = kw_shape[2];
    const int G = ks_shape[3];                   // groups per row
    const int gshift = 31 - __clz(D / G);
    const int C = (TT + CHUNK - 1) / CHUNK;
    const int b = blockIdx.y / HKV, h = blockIdx.y % HKV;
    const int chunk = blockIdx.x * WARPS + warp;
    if (chunk >= C) return;  // (only warp-level synchronization below)
    // Chunks start at the row's first position, so its split does not depend on its padding;
    // a chunk past the row's end is empty (max -inf, sum 0).
    const int lo = max((int)lp[b], 0);
    const int t_begin = lo + chunk * CHUNK, t_end = min(TT, t_begin + CHUNK);
    const float sc = scale[0] * LOG2E;

    const uint32_t* kwb = kw + b * kw_strides[0] + h * kw_strides[1];
    const T* ksb = ks + b * ks_strides[0] + h * ks_strides[1];
    const T* kbb = kb + b * kb_strides[0] + h * kb_strides[1];
    const uint32_t* vwb = vw + b * vw_strides[0] + h * vw_strides[1];
    const T* vsb = vs + b * vs_strides[0] + h * vs_strides[1];
    const T* vbb = vb + b * vb_strides[0] + h * vb_strides[1];

    // The group's queries as A fragments: rows g and g + 8 (heads), the lane's 32 dims
    // [32t, 32t + 32) in the keys' pairing (4-bit: (e_i, e_i+4), (e_i+1, e_i+5); 8-bit: natural).
    uint32_t qa[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = g + 8 * hh;
            uint32_t lo_pair = 0, hi_pair = 0;
            if (r < R) {
                const T* qr = q + ((size_t)b * HQ + (size_t)h * R + r) * D + 32 * t;
                if constexpr (BITS == 4) {
                    const int base = 8 * (s >> 1) + 2 * (s & 1);
                    lo_pair = kvq_pack<T>(static_cast<float>(qr[base]), static_cast<float>(qr[base + 4]));
                    hi_pair = kvq_pack<T>(static_cast<float>(qr[base + 1]), static_cast<float>(qr[base + 5]));
                } else {
                    lo_pair = kvq_pair<T>(qr + 4 * s);
                    hi_pair = kvq_pair<T>(qr + 4 * s + 2);
                }
            }
            qa[s][hh] = lo_pair;       // a0 (row g) / a1 (row g + 8): k = 2t, 2t + 1
            qa[s][2 + hh] = hi_pair;   // a2 / a3: k = 2t + 8, 2t + 9
        }
    }

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    T* vw_s = vsm[warp];

    constexpr int VW = 64 * BITS / 32;  // packed words of a lane's 64 value dims (8 or 16)
    const int vpp = lane >> 1, vhalf = lane & 1;  // values: lane -> position vpp, dims [64 vhalf, + 64)
    for (int t0 = t_begin; t0 < t_end; t0 += 16) {
        // The values' words first, so their loads are in flight with the keys'.
        const int vp = t0 + vpp;
        const bool vvalid = vp >= lo && vp < t_end;
        uint32_t vwords[VW];
        if (vvalid) {
            const uint32_t* row = vwb + (size_t)vp * vw_strides[2] + vhalf * VW;
#pragma unroll
            for (int i = 0; i < VW; i += 4) {
                const uint4 v4 = *reinterpret_cast<const uint4*>(row + i);
                vwords[i] = v4.x; vwords[i + 1] = v4.y; vwords[i + 2] = v4.z; vwords[i + 3] = v4.w;
            }
        }
        // -- scores of 16 positions: two n tiles of 8 (lane g: position t0 + 8j + g) --
        float sc_frag[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int p = t0 + 8 * j + g;
            uint32_t kwords[LW];
            uint32_t s2 = 0, b2 = 0;
            if (p < TT) {
                const uint32_t* row = kwb + (size_t)p * kw_strides[2] + t * LW;
#pragma unroll
                for (int i = 0; i < LW; i += 4) {
                    const uint4 v4 = *reinterpret_cast<const uint4*>(row + i);
                    kwords[i] = v4.x; kwords[i + 1] = v4.y; kwords[i + 2] = v4.z; kwords[i + 3] = v4.w;
                }
                kvq_group<T>(ksb + (size_t)p * ks_strides[2], kbb + (size_t)p * kb_strides[2], (32 * t) >> gshift,
                             s2, b2);
            } else {
#pragma unroll
                for (int i = 0; i < LW; ++i) kwords[i] = 0;
            }
            float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                uint32_t b0, b1;
                if constexpr (BITS == 4) {
                    const uint32_t w = kwords[s >> 1];
                    if ((s & 1) == 0) { b0 = qmm_dq4<T, 0>(w, s2, b2); b1 = qmm_dq4<T, 4>(w, s2, b2); }
                    else { b0 = qmm_dq4<T, 8>(w, s2, b2); b1 = qmm_dq4<T, 12>(w, s2, b2); }
                } else {
                    const uint32_t w = kwords[s];
                    b0 = qmm_dq8<T, 0>(w, s2, b2);
                    b1 = qmm_dq8<T, 2>(w, s2, b2);
                }
                qmm_mma<T>(c4, qa[s][0], qa[s][1], qa[s][2], qa[s][3], b0, b1);
            }
            // c0, c1: head g, positions t0 + 8j + 2t, + 1; c2, c3: head g + 8.
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int p2 = t0 + 8 * j + 2 * t + (c & 1);
                sc_frag[j][c] = (p2 >= lo && p2 < t_end) ? c4[c] * sc : -INFINITY;
            }
        }

"""
    + split_attention.ONLINE_SOFTMAX
    + r"""

        // -- values of the 16 positions (loaded above), dequantized into shared memory --
        {
            T* dst = vw_s + vpp * VROW + 64 * vhalf;
            if (vvalid) {
                const T* srow = vsb + (size_t)vp * vs_strides[2];
                const T* brow = vbb + (size_t)vp * vb_strides[2];
#pragma unroll
                for (int i = 0; i < VW; ++i) {
                    if constexpr (BITS == 4) {  // word i: dims 8i .. 8i + 7 of the half
                        const int d0 = 64 * vhalf + 8 * i;
                        uint32_t s2, b2;
                        kvq_group<T>(srow, brow, d0 >> gshift, s2, b2);
                        const uint32_t p0 = qmm_dq4<T, 0>(vwords[i], s2, b2), p1 = qmm_dq4<T, 4>(vwords[i], s2, b2);
                        const uint32_t p2 = qmm_dq4<T, 8>(vwords[i], s2, b2), p3 = qmm_dq4<T, 12>(vwords[i], s2, b2);
                        uint4 o;  // (e0 e1) (e2 e3) (e4 e5) (e6 e7) from (e0 e4) (e1 e5) (e2 e6) (e3 e7)
                        o.x = __byte_perm(p0, p1, 0x5410);
                        o.y = __byte_perm(p2, p3, 0x5410);
                        o.z = __byte_perm(p0, p1, 0x7632);
                        o.w = __byte_perm(p2, p3, 0x7632);
                        *reinterpret_cast<uint4*>(dst + 8 * i) = o;
                    } else if (i % 2 == 0) {  // words i, i + 1: dims 4i .. 4i + 7 of the half
                        const int d0 = 64 * vhalf + 4 * i;
                        uint32_t s2, b2;
                        kvq_group<T>(srow, brow, d0 >> gshift, s2, b2);
                        uint4 o;
                        o.x = qmm_dq8<T, 0>(vwords[i], s2, b2);
                        o.y = qmm_dq8<T, 2>(vwords[i], s2, b2);
                        o.z = qmm_dq8<T, 0>(vwords[i + 1], s2, b2);
                        o.w = qmm_dq8<T, 2>(vwords[i + 1], s2, b2);
                        *reinterpret_cast<uint4*>(dst + 4 * i) = o;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < 64; i += 8) *reinterpret_cast<uint4*>(dst + i) = make_uint4(0, 0, 0, 0);
            }
        }
"""
    + split_attention.PV_PRODUCT
    + "\n"
    + split_attention.PARTIALS
)


_kernels: dict[tuple[Any, ...], Any] = {}
_zero_pad: dict[int, mx.array] = {}


def _name(kind: str, dtype: mx.Dtype, bits: int, group: int) -> str:
    t = "bf16" if dtype == mx.bfloat16 else "f16"
    # The combine reads only float32 partials: one kernel per dtype (each name is an NVRTC compile).
    return f"kvq_combine_{t}" if kind == "combine" else f"kvq_{kind}_{t}_b{bits}_r{group}_c{CHUNK}"


def _sources(dtype: mx.Dtype, bits: int, group: int) -> dict[str, tuple[str, str]]:
    t = "__nv_bfloat16" if dtype == mx.bfloat16 else "__half"
    consts = (
        f"    using T = {t};\n    constexpr int BITS = {bits};\n    constexpr int R = {group};\n"
        f"    constexpr int CHUNK = {CHUNK};\n    constexpr int WARPS = {split_attention.WARPS};\n"
    )
    header = _HEADER + "\n#define QMM_GATHER 0\n#define QMM_CLUSTER 0\n"
    return {
        "attend": (header, consts + _ATTEND),
        "combine": (header, f"    using T = {t};\n" + split_attention.COMBINE),
    }


_INPUTS = {
    "attend": ["q", "kw", "ks", "kb", "vw", "vs", "vb", "lp", "scale"],
    "combine": ["pm", "pl", "pacc"],
}
_OUTPUTS = {"attend": ["pm", "pl", "pacc"], "combine": ["out"]}


def _kernel(kind: str, dtype: mx.Dtype, bits: int, group: int) -> Any:
    key = (kind, dtype) if kind == "combine" else (kind, dtype, bits, group)
    if key not in _kernels:
        header, body = _sources(dtype, bits, group)[kind]
        _kernels[key] = cuda_build.kernel(
            name=_name(kind, dtype, bits, group),
            input_names=_INPUTS[kind],
            output_names=_OUTPUTS[kind],
            source=body,
            header=header,
            ensure_row_contiguous=kind == "combine",
        )
    return _kernels[key]


def usable(queries: mx.array, keys: tuple[mx.array, ...], bits: int, group_size: int) -> bool:
    """Whether this decode step's attention can take the kernels: a CUDA GPU, one query per row,
    head_dim 128, 4/8-bit keys in supported groups, at most 16 query heads per KV head."""
    if not quant_kernel.available() or queries.ndim != 4 or queries.shape[2] != 1:
        return False
    if queries.shape[-1] != HEAD_DIM or bits not in quant_kernel.BITS or group_size not in quant_kernel.GROUP_SIZES:
        return False
    if queries.dtype not in quant_kernel.DTYPES or keys[1].dtype != queries.dtype or len(keys) != 3:
        return False
    n_q, n_kv = queries.shape[1], keys[0].shape[1]
    if not (n_kv > 0 and n_q % n_kv == 0 and n_q // n_kv <= MAX_GROUP and keys[0].shape[2] > 0):
        return False
    key = (queries.dtype, bits, group_size, n_q // n_kv)
    if key not in _verified:
        _verified[key] = _self_check(*key)
    return _verified[key]


_verified: dict[tuple[mx.Dtype, int, int, int], bool] = {}


def _self_check(dtype: mx.Dtype, bits: int, group_size: int, group: int) -> bool:
    """Once per configuration (eagerly, at its first decode step): the kernels against attention
    over the dequantized cache on a small case; one that fails or disagrees is never used (and
    the log says why: the caches then dequantize every step)."""
    what = f"quantized-KV decode attention kernel ({dtype}, {bits}-bit, group size {group_size}, {group} heads/KV head)"
    try:
        k_ = mx.random.key(group)
        q = mx.random.normal((2, group, 1, HEAD_DIM), key=k_).astype(dtype)
        triples: list[tuple[mx.array, mx.array, mx.array]] = []
        for i in (1, 2):
            x = mx.random.normal((2, 1, 300, HEAD_DIM), key=mx.random.key(i)).astype(dtype)
            w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
            triples.append((w, s, b))
        got = decode_attention(q, triples[0], triples[1], HEAD_DIM**-0.5, mx.array([0, 37]), bits)
        kd, vd = (mx.dequantize(w, s, b, group_size=group_size, bits=bits) for w, s, b in triples)
        mask = (mx.arange(300) >= mx.array([0, 37])[:, None])[:, None, None, :]
        want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=HEAD_DIM**-0.5, mask=mask)
        err: float = (mx.abs(got - want).max() / mx.abs(want).max()).item()  # type: ignore[assignment]
    except Exception as e:  # noqa: BLE001 - the caches keep their own path
        log.warning("%s off: %r", what, e)
        return False
    if not err < 3e-2:
        log.warning("%s off: differs from attention over the dequantized cache by %.3g", what, err)
        return False
    log.info("%s on (checked: %.2g from attention over the dequantized cache)", what, err)
    return True


def decode_attention(
    queries: mx.array,
    keys: tuple[mx.array, mx.array, mx.array],
    values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    left_padding: mx.array | None,
    bits: int,
) -> mx.array:
    """softmax(scale * q @ K.T) @ V for one query per row over quantized K/V ([B, Hkv, T, ...]
    triples, views welcome), positions before each row's `left_padding` masked; [B, Hq, 1, D]."""
    B, n_q = queries.shape[:2]
    n_kv, length = keys[0].shape[1], keys[0].shape[2]
    group = n_q // n_kv
    chunks = -(-length // CHUNK)
    if left_padding is None:
        left_padding = _zero_pad.get(B)
        if left_padding is None:
            left_padding = _zero_pad[B] = mx.zeros((B,), mx.int32)
    inputs = [mx.contiguous(queries), *keys, *values, left_padding.astype(mx.int32), split_attention.scale_array(scale)]
    kernels = (_kernel("attend", queries.dtype, bits, group), _kernel("combine", queries.dtype, bits, group))
    return split_attention.attend_and_combine(*kernels, inputs, queries, n_kv, chunks)


def compile_check_sources(quick: bool = False) -> list[tuple[str, str, str, list, list]]:
    """(name, header, body, inputs, outputs) of each kernel, for benchmarks/kernel_compile_check.py."""
    out = []
    for dtype in (mx.bfloat16,) if quick else (mx.bfloat16, mx.float16):
        for bits in (4, 8):
            for group in (4, 8) if quick else (1, 4, 8, 16):
                src = _sources(dtype, bits, group)
                quant = [("w", mx.uint32), ("s", dtype), ("b", dtype)]
                tensors = [(f"{kv}{x}", d, 4) for kv in ("k", "v") for x, d in quant]
                inputs = [("q", dtype, 4), *tensors, ("lp", mx.int32, 1), ("scale", mx.float32, 1)]
                outputs = [("pm", mx.float32), ("pl", mx.float32), ("pacc", mx.float32)]
                out.append((_name("attend", dtype, bits, group), *src["attend"], inputs, outputs))
                if (bits, group) == (4, 4 if quick else 1):  # (one combine per dtype)
                    combine_in = [("pm", mx.float32, 3), ("pl", mx.float32, 3), ("pacc", mx.float32, 4)]
                    out.append((_name("combine", dtype, bits, group), *src["combine"], combine_in, [("out", dtype)]))
    return out
