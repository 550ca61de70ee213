"""Decode attention over the paged KV pool on CUDA (model/kv/paged.py): one kernel reads each
row's keys and values block by block through its block table, a second adds up the blocks.

Gathering a row's blocks into one buffer before MLX's fused attention costs several times the
attention itself on an H100 (benchmarks/paged_gather_cost.py: 4.6-9.6x), so a decode step reads
the pool in place. The structure is model/kv/quant_kernel.py's flash-decoding, over bf16/f16
blocks instead of quantized rows, each chunk exactly one block:

* one warp per (row, KV head, block of BLOCK positions), all the query heads of its GQA group
  (up to 16) at once, 16 positions a step: the queries are the A operand of `mma.sync` m16n8k16,
  kept in registers; keys are the B operand, read straight from the block, each lane's D/4
  contiguous dims of a position (the queries read in the same k order, so the dot products are
  the same sums);
* an online softmax in float32 (exp2, scores scaled by scale * log2 e), positions at or past
  the row's length masked;
* values staged by the warp in shared memory, `ldmatrix.trans` giving the B operand of P @ V,
  P coming straight from the score fragments.

Each block writes its running max, sum and unnormalized output (float32); the second kernel
combines a (row, head)'s blocks in order. A row's blocks and their order are its own, so its
output never depends on the rows decoding with it. Head dims 64 and 128; anything else (prefill,
speculative verification, Metal, CPU) gathers (model/kv/paged.py). Each configuration is checked
against attention over the gathered rows at its first use, and not used if it disagrees.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from model import quant_kernel
from model.kernels import cuda_build
from model.kv import quant_kernel as kv_quant_kernel
from model.kv import split_attention

log = logging.getLogger(__name__)

BLOCK = 256  # positions per pool block (model/kv/paged.py): one warp's chunk
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head: the rows of one mma tile
DTYPES = (mx.bfloat16, mx.float16)

# Set False (benchmarks only) to measure the gather path on the same process.
ENABLED = True

# Kernel 1: one warp per (row, KV head, block). Constants from `_sources`: T, D, R (query heads
# per KV head), BLOCK, WARPS. Inputs row-contiguous: q [B, HQ, 1, D], kp / vp [blocks, HKV,
# BLOCK, D], tbl [B, C] int32 (C: blocks of the longest row), lens [B] int32, scale [1] float32.
_ATTEND = (
    r"""
    constexpr int KSTEPS = D / 16;               // mma k steps over the head dimension
    constexpr int LW = D / 8;                    // 32-bit words of a lane's D/4 key dims
    constexpr int VQ = D / 16;                   // 16-byte loads of a lane's D/2 value dims
    constexpr int VROW = D + 8;                  // shared V row stride, in elements
    constexpr float LOG2E = 1.4426950408889634f;

    __shared__ __align__(16) T vsm[WARPS][16 * VROW];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int HQ = q_shape[1], HKV = kp_shape[1], C = tbl_shape[1];
    const int b = blockIdx.y / HKV, h = blockIdx.y % HKV;
    const int chunk = blockIdx.x * WARPS + warp;
    if (chunk >= C) return;  // (only warp-level synchronization below)
    const int len = lens[b];
    // A block past the row's end reads nothing: its partials are empty (max -inf, sum 0).
    const int t_begin = chunk * BLOCK, t_end = min(len, t_begin + BLOCK);
    const float sc = scale[0] * LOG2E;
    const size_t blk = t_end > t_begin ? (size_t)tbl[(size_t)b * C + chunk] : 0;
    const T* kbase = kp + (blk * HKV + h) * (size_t)(BLOCK * D);
    const T* vbase = vp + (blk * HKV + h) * (size_t)(BLOCK * D);

    // The group's queries as A fragments: rows g and g + 8 (heads); in k step s the lane's k
    // (2t, 2t + 1) are dims D/4 t + 4s + (0, 1) and (2t + 8, 2t + 9) are + (2, 3), as its keys.
    uint32_t qa[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = g + 8 * hh;
            uint32_t lo_pair = 0, hi_pair = 0;
            if (r < R) {
                const T* qr = q + ((size_t)b * HQ + (size_t)h * R + r) * D + (D / 4) * t + 4 * s;
                lo_pair = kvq_pair<T>(qr);
                hi_pair = kvq_pair<T>(qr + 2);
            }
            qa[s][hh] = lo_pair;       // a0 (row g) / a1 (row g + 8)
            qa[s][2 + hh] = hi_pair;   // a2 / a3
        }
    }

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    T* vw_s = vsm[warp];

    const int vpp = lane >> 1, vhalf = lane & 1;  // values: lane -> position vpp, dims [D/2 vhalf, + D/2)
    for (int t0 = t_begin; t0 < t_end; t0 += 16) {
        // The values first, so their loads are in flight with the keys'. Every position read
        // lies in this block (t0 + 15 < t_begin + BLOCK); those past the row's end are masked.
        const int vp = t0 + vpp;
        const bool vvalid = vp < t_end;
        uint4 vwords[VQ];
        {
            const uint4* row = reinterpret_cast<const uint4*>(vbase + (size_t)(vp - t_begin) * D + (D / 2) * vhalf);
#pragma unroll
            for (int i = 0; i < VQ; ++i) vwords[i] = vvalid ? row[i] : make_uint4(0, 0, 0, 0);
        }
        // -- scores of 16 positions: two n tiles of 8 (lane g: position t0 + 8j + g) --
        float sc_frag[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int p = t0 + 8 * j + g;
            uint32_t kwords[LW];
            const uint4* row = reinterpret_cast<const uint4*>(kbase + (size_t)(p - t_begin) * D + (D / 4) * t);
#pragma unroll
            for (int i = 0; i < LW / 4; ++i) {
                const uint4 v4 = row[i];
                kwords[4 * i] = v4.x; kwords[4 * i + 1] = v4.y; kwords[4 * i + 2] = v4.z; kwords[4 * i + 3] = v4.w;
            }
            float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s)
                qmm_mma<T>(c4, qa[s][0], qa[s][1], qa[s][2], qa[s][3], kwords[2 * s], kwords[2 * s + 1]);
            // c0, c1: head g, positions t0 + 8j + 2t, + 1; c2, c3: head g + 8.
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int p2 = t0 + 8 * j + 2 * t + (c & 1);
                sc_frag[j][c] = p2 < t_end ? c4[c] * sc : -INFINITY;
            }
        }

"""
    + split_attention.ONLINE_SOFTMAX
    + r"""

        // -- the 16 positions' values into shared memory (zeros past the row's end) --
        {
            T* dst = vw_s + vpp * VROW + (D / 2) * vhalf;
#pragma unroll
            for (int i = 0; i < VQ; ++i) *reinterpret_cast<uint4*>(dst + 8 * i) = vwords[i];
        }
"""
    + split_attention.PV_PRODUCT
    + "\n"
    + split_attention.PARTIALS
)

_kernels: dict[tuple[Any, ...], Any] = {}


def _name(kind: str, dtype: mx.Dtype, head_dim: int, group: int) -> str:
    t = "bf16" if dtype == mx.bfloat16 else "f16"
    # The combine reads only float32 partials: one kernel per dtype (each name is an NVRTC compile).
    return f"kvp_combine_{t}" if kind == "combine" else f"kvp_{kind}_{t}_d{head_dim}_r{group}"


def _sources(dtype: mx.Dtype, head_dim: int, group: int) -> dict[str, tuple[str, str]]:
    t = "__nv_bfloat16" if dtype == mx.bfloat16 else "__half"
    consts = (
        f"    using T = {t};\n    constexpr int D = {head_dim};\n    constexpr int R = {group};\n"
        f"    constexpr int BLOCK = {BLOCK};\n    constexpr int WARPS = {split_attention.WARPS};\n"
    )
    # The quantized-KV kernel's header (mma, packing, ldmatrix.trans) and combine (the same
    # float32 partials, combined in order).
    header = kv_quant_kernel._HEADER + "\n#define QMM_GATHER 0\n#define QMM_CLUSTER 0\n"
    combine = f"    using T = {t};\n" + split_attention.COMBINE
    return {"attend": (header, consts + _ATTEND), "combine": (header, combine)}


_INPUTS = {"attend": ["q", "kp", "vp", "tbl", "lens", "scale"], "combine": ["pm", "pl", "pacc"]}
_OUTPUTS = {"attend": ["pm", "pl", "pacc"], "combine": ["out"]}


def _kernel(kind: str, dtype: mx.Dtype, head_dim: int, group: int) -> Any:
    key = (kind, dtype) if kind == "combine" else (kind, dtype, head_dim, group)
    if key not in _kernels:
        header, body = _sources(dtype, head_dim, group)[kind]
        _kernels[key] = cuda_build.kernel(
            name=_name(kind, dtype, head_dim, group),
            input_names=_INPUTS[kind],
            output_names=_OUTPUTS[kind],
            source=body,
            header=header,
            ensure_row_contiguous=True,
        )
    return _kernels[key]


def usable(queries: mx.array, keys: mx.array, values: mx.array | None) -> bool:
    """Whether this decode step's attention over pools `keys` / `values` can take the kernels: a
    CUDA GPU, one query per row, head dim 64 or 128 (keys and values alike), bf16/f16, at most 16
    query heads per KV head, and the configuration passed its first-use check."""
    if not (ENABLED and quant_kernel.available()) or values is None or queries.ndim != 4 or queries.shape[2] != 1:
        return False
    D = queries.shape[-1]
    if D not in HEAD_DIMS or keys.shape[-1] != D or values.shape[-1] != D or keys.shape[2] != BLOCK:
        return False
    if queries.dtype not in DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        return False
    n_q, n_kv = queries.shape[1], keys.shape[1]
    if not (n_kv > 0 and n_q % n_kv == 0 and n_q // n_kv <= MAX_GROUP):
        return False
    key = (queries.dtype, D, n_q // n_kv)
    if key not in _verified:
        _verified[key] = _self_check(*key)
    return _verified[key]


_verified: dict[tuple[mx.Dtype, int, int], bool] = {}


def gathered_attention(
    queries: mx.array, keys: mx.array, values: mx.array, tables: list[list[int]], lengths: list[int], scale: float
) -> mx.array:
    """The reference: each row's blocks gathered into one buffer and MLX's fused attention over
    its `lengths[i]` positions, one row at a time; [B, Hq, 1, D]."""
    out = []
    for i, (table, n) in enumerate(zip(tables, lengths)):
        idx = mx.array(table)
        k, v = (p[idx].transpose(1, 0, 2, 3).reshape(1, p.shape[1], -1, p.shape[-1]) for p in (keys, values))
        out.append(mx.fast.scaled_dot_product_attention(queries[i : i + 1], k[..., :n, :], v[..., :n, :], scale=scale))
    return mx.concatenate(out)


def _self_check(dtype: mx.Dtype, head_dim: int, group: int) -> bool:
    """Once per configuration (eagerly, at its first decode step): the kernels against attention
    over the gathered rows on a small case (rows spanning blocks out of order, one ending inside
    its first block); one that fails or disagrees is never used, and the log says why (the paged
    caches then gather every step)."""
    what = f"paged-KV decode attention kernel ({dtype}, head dim {head_dim}, {group} heads/KV head)"
    try:
        heads, scale = 2, head_dim**-0.5
        tables, lengths = [[3, 1], [2]], [300, 37]
        q = mx.random.normal((2, heads * group, 1, head_dim), key=mx.random.key(group)).astype(dtype)
        kp, vp = (mx.random.normal((4, heads, BLOCK, head_dim), key=mx.random.key(i)).astype(dtype) for i in (1, 2))
        table = mx.array([[3, 1], [2, 0]], mx.int32)
        got = decode_attention(q, kp, vp, table, mx.array(lengths, mx.int32), scale)
        want = gathered_attention(q, kp, vp, tables, lengths, scale)
        err: float = (mx.abs(got - want).max() / mx.abs(want).max()).item()  # type: ignore[assignment]
    except Exception as e:  # noqa: BLE001 - the caches keep their own path
        log.warning("%s off: %r", what, e)
        return False
    if not err < 3e-2:
        log.warning("%s off: differs from attention over the gathered rows by %.3g", what, err)
        return False
    log.info("%s on (checked: %.2g from attention over the gathered rows)", what, err)
    return True


def decode_attention(
    queries: mx.array, keys: mx.array, values: mx.array, table: mx.array, lengths: mx.array, scale: float
) -> mx.array:
    """softmax(scale * q @ K.T) @ V for one query per row over the pool (`keys` / `values`
    [blocks, Hkv, BLOCK, D]), row i's positions [0, lengths[i]) in blocks `table[i]` ([B, C]
    int32, C at least the longest row's blocks); [B, Hq, 1, D]."""
    n_q, D = queries.shape[1], queries.shape[3]
    n_kv = keys.shape[1]
    group, chunks = n_q // n_kv, table.shape[1]
    sc = split_attention.scale_array(scale)
    inputs = [queries, keys, values, table.astype(mx.int32), lengths.astype(mx.int32), sc]
    kernels = (_kernel("attend", queries.dtype, D, group), _kernel("combine", queries.dtype, D, group))
    return split_attention.attend_and_combine(*kernels, inputs, queries, n_kv, chunks)


def compile_check_sources(quick: bool = False) -> list[tuple[str, str, str, list, list]]:
    """(name, header, body, inputs, outputs) of each kernel, for benchmarks/kernel_compile_check.py."""
    out = []
    for dtype in (mx.bfloat16,) if quick else (mx.bfloat16, mx.float16):
        for head_dim in HEAD_DIMS:
            for group in (4, 8) if quick else (1, 4, 8, 16):
                src = _sources(dtype, head_dim, group)
                inputs = [("q", dtype, 4), ("kp", dtype, 4), ("vp", dtype, 4), ("tbl", mx.int32, 2)]
                inputs += [("lens", mx.int32, 1), ("scale", mx.float32, 1)]
                outputs = [("pm", mx.float32), ("pl", mx.float32), ("pacc", mx.float32)]
                out.append((_name("attend", dtype, head_dim, group), *src["attend"], inputs, outputs))
                if (head_dim, group) == (HEAD_DIMS[0], 4 if quick else 1):  # (one combine per dtype)
                    combine_in = [("pm", mx.float32, 3), ("pl", mx.float32, 3), ("pacc", mx.float32, 4)]
                    name = _name("combine", dtype, head_dim, group)
                    out.append((name, *src["combine"], combine_in, [("out", dtype)]))
    return out
