"""The decoder-only transformer every supported family is a variant of.

Parameter names follow Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...), so
weights load by name. The op sequence mirrors mlx-lm's llama/qwen2/qwen3 modules exactly: greedy
outputs must be token-identical to `mlx_lm.generate` on the same weights.

Family files (model/families/*.py) only translate a config.json into `DecoderArgs`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model import cpu_attention, cpu_exact

log = logging.getLogger(__name__)


@attrs.frozen
class DecoderArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False  # llama's flag: q/k/v/o all biased
    qkv_bias: bool = False  # qwen2: q/k/v biased, o not
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    # On the CPU, float32: the same bits from a faster exp (model/cpu_exact.py).
    if cpu_exact.applies(gate, x):
        return cpu_exact.swiglu(gate, x)
    return _swiglu(gate, x)


# -- decode GEMV on CUDA ----------------------------------------------------------------------
#
# A decode step multiplies 1..8 rows by every weight matrix: pure weight streaming. MLX's CUDA
# gemv (M == 1 only) loads 8 bytes per lane with a runtime-bounded loop, and M = 2..8 goes to a
# cuBLAS GEMM that streams the weights about as slowly per row block; both stay near half of
# HBM bandwidth on an H200. This kernel gives each weight row one warp, loads 16 bytes per lane
# with independent unrolled loads, and applies every x row to each loaded weight vector, so the
# weights are read once for up to GEMV_MAX_ROWS rows. fp32 accumulation, like MLX's. Only
# bias-free bf16/fp16 Linear layers on a CUDA device use it, opt-in with MLX_TRIO_GEMV=1 until it has
# been measured on a GPU (it has not: see docs/performance.md).

GEMV_MAX_ROWS = 8

_GEMV_HEADER = """
template <int W> struct TrioVec;
template <> struct TrioVec<4> {
    static __device__ __forceinline__ void load(const char* p, unsigned* o) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(p)); o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
    }
};
template <> struct TrioVec<2> {
    static __device__ __forceinline__ void load(const char* p, unsigned* o) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p)); o[0] = v.x; o[1] = v.y;
    }
};
// The two 16-bit elements of a little-endian 32-bit word, as floats (exact conversions).
__device__ __forceinline__ float trio_lo(unsigned w, const __nv_bfloat16*) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float trio_hi(unsigned w, const __nv_bfloat16*) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float trio_lo(unsigned w, const __half*) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float trio_hi(unsigned w, const __half*) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

// One warp per weight row; W 32-bit words (2W elements) per lane per load; every x row reuses
// each loaded weight vector.
template <typename T, int W, int MAXM>
__device__ __forceinline__ void trio_gemv_row(const T* x, const T* w, T* y, int N, int K, int M, int row, int lane) {
    constexpr int E = 2 * W;
    const int KV = K / E;
    const char* wrow = reinterpret_cast<const char*>(w + (size_t)row * K);
    float acc[MAXM];
    #pragma unroll
    for (int m = 0; m < MAXM; ++m) acc[m] = 0.0f;
    #pragma unroll 4
    for (int i = lane; i < KV; i += 32) {
        unsigned wv[W];
        TrioVec<W>::load(wrow + (size_t)i * E * 2, wv);
        float wf[E];
        #pragma unroll
        for (int j = 0; j < W; ++j) {
            wf[2 * j] = trio_lo(wv[j], w);
            wf[2 * j + 1] = trio_hi(wv[j], w);
        }
        #pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                unsigned xw[W];
                TrioVec<W>::load(reinterpret_cast<const char*>(x + (size_t)m * K) + (size_t)i * E * 2, xw);
                float s = acc[m];
                #pragma unroll
                for (int j = 0; j < W; ++j) {
                    s = fmaf(wf[2 * j], trio_lo(xw[j], x), s);
                    s = fmaf(wf[2 * j + 1], trio_hi(xw[j], x), s);
                }
                acc[m] = s;
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MAXM; ++m) {
        if (m < M) {
            float v = acc[m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) y[(size_t)m * N + row] = static_cast<T>(v);
        }
    }
}
"""

_GEMV_SOURCE = """
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int M = x_shape[0];
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= N) return;
    const size_t align = reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(x);
    if ((align & 15) == 0) {
        trio_gemv_row<T, 4, MAXM>(x, w, y, N, K, M, row, lane);
    } else if ((align & 7) == 0) {
        trio_gemv_row<T, 2, MAXM>(x, w, y, N, K, M, row, lane);
    } else {
        for (int m = 0; m < M && m < MAXM; ++m) {
            float v = 0.0f;
            for (int k = lane; k < K; k += 32)
                v = fmaf(static_cast<float>(w[(size_t)row * K + k]), static_cast<float>(x[(size_t)m * K + k]), v);
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) y[(size_t)m * N + row] = static_cast<T>(v);
        }
    }
"""

_gemv_state: dict[str, Any] = {}


def _gemv_kernel() -> Any:
    """The compiled kernel, or None where unavailable (not CUDA, disabled, or failed its check)."""
    if "kernel" in _gemv_state:
        return _gemv_state["kernel"]
    kernel = None
    try:
        if (
            os.environ.get("MLX_TRIO_GEMV", "0") == "1"
            and mx.default_device().type == mx.gpu
            and hasattr(mx, "cuda")
            and mx.cuda.is_available()
        ):
            kernel = mx.fast.cuda_kernel(
                name="mlx_trio_gemv",
                input_names=["x", "w"],
                output_names=["y"],
                source=_GEMV_SOURCE,
                header=_GEMV_HEADER,
            )
            _gemv_state["kernel"] = kernel
            flat = (mx.random.normal((1000 * 4096 + 4,), key=mx.random.key(9)) * 0.02).astype(mx.bfloat16)
            for m, w in (
                (1, flat[:-4].reshape(1000, 4096)),
                (3, flat[4:].reshape(1000, 4096)),
                (GEMV_MAX_ROWS, flat[:-4].reshape(1000, 4096)),
                (2, flat[1:-3].reshape(1000, 4096)),
            ):
                # against MLX's matmul before it is trusted: 16-, 8- and 2-byte aligned weights
                x = mx.random.normal((m, 4096), key=mx.random.key(m)).astype(mx.bfloat16)
                # (MLX's own matmul rejects a 2-byte-aligned view: compare with a fresh copy)
                ref = (x @ mx.contiguous(w + 0).T).astype(mx.float32)
                err = mx.abs(_gemv_call(kernel, x, w).astype(mx.float32) - ref).max().item()
                if not err <= 0.02 * max(1.0, mx.abs(ref).max().item()):
                    raise RuntimeError(f"gemv self-check failed (M={m}): max error {err}")
            log.info("decode GEMV kernel enabled (CUDA)")
    except Exception as e:  # noqa: BLE001 - the MLX matmul is always there to fall back on
        log.warning("decode GEMV kernel unavailable, using MLX matmul: %s", e)
        kernel = None
    _gemv_state["kernel"] = kernel
    return kernel


def _gemv_call(kernel: Any, x2: mx.array, w: mx.array) -> mx.array:
    n = w.shape[0]
    return kernel(
        inputs=[x2, w],
        template=[("T", w.dtype), ("MAXM", GEMV_MAX_ROWS)],
        grid=(((n + 7) // 8) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(x2.shape[0], n)],
        output_dtypes=[w.dtype],
    )[0]


def _rows_bucket(rows: int) -> int:
    return 1 if rows == 1 else 2 if rows == 2 else 4 if rows <= 4 else 8


def tune_gemv(weights: list[mx.array]) -> dict[str, Any]:
    """Time the kernel against MLX's matmul on these (real, as-loaded) weights for 2, 4 and 8
    rows, and record per (N, K, rows) which is faster; `linear_nt` follows the table (default:
    the kernel). One row always uses MLX's own gemv (decent, and what mlx-lm computes: B = 1
    stays token-identical); 2..8 rows otherwise go to a cuBLAS GEMM with a large fixed cost.
    Returns the timings (µs)."""
    kernel = _gemv_kernel()
    report: dict[str, Any] = {}
    if kernel is None:
        return report
    table = _gemv_state.setdefault("table", {})
    for w in weights:
        if w.ndim != 2 or w.dtype not in (mx.bfloat16, mx.float16) or w.shape[1] % 8:
            continue
        n, k = w.shape
        for m in (2, 4, 8):  # one row stays on MLX's gemv: B = 1 results equal mlx-lm's
            if (n, k, m) in table:
                continue
            x = mx.random.normal((m, k), key=mx.random.key(m)).astype(w.dtype)
            best = {}
            for name, fn in (("kernel", lambda: _gemv_call(kernel, x, w)), ("mlx", lambda: x @ w.T)):
                mx.eval(fn())
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    mx.eval([fn() for _ in range(10)])
                    times.append((time.perf_counter() - t0) / 10)
                best[name] = min(times)
            table[(n, k, m)] = best["kernel"] < 0.95 * best["mlx"]
            report[f"{n}x{k}_M{m}"] = {
                "kernel_us": 1e6 * best["kernel"],
                "mlx_us": 1e6 * best["mlx"],
                "uses_kernel": table[(n, k, m)],
            }
    return report


def linear_nt(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T: the decode GEMV kernel where it applies (and is faster), else MLX's matmul."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if (
        0 < rows <= GEMV_MAX_ROWS
        and w.ndim == 2
        and x.dtype == w.dtype
        and w.dtype in (mx.bfloat16, mx.float16)
        and w.shape[1] % 8 == 0
    ):
        kernel = _gemv_kernel()
        if kernel is not None:
            use = rows > 1 and _gemv_state.get("table", {}).get((w.shape[0], w.shape[1], _rows_bucket(rows)), True)
            if use:
                return _gemv_call(kernel, x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return x @ w.T


class gemv_disabled:
    """Context manager: the MLX matmul everywhere (benchmarks' A/B; graphs traced inside keep it)."""

    def __enter__(self) -> None:
        self._saved = _gemv_kernel()
        _gemv_state["kernel"] = None

    def __exit__(self, *exc: Any) -> None:
        _gemv_state["kernel"] = self._saved


class Linear(nn.Linear):
    """nn.Linear whose bias-free decode-sized products may take the CUDA GEMV kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return super().__call__(x)
        return linear_nt(x, self["weight"])


class Llama3RoPE(nn.Module):
    """RoPE with Llama 3.1's frequency-dependent scaling (rope_type "llama3")."""

    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict[str, Any]):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context_len = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor

        freqs = base ** (mx.arange(0, dims, 2) / dims)
        wavelens = 2 * mx.pi * freqs
        freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
        is_medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
        smooth = (old_context_len / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
        self._freqs = mx.where(is_medium, smooth_freqs, freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def make_rope(dims: int, args: DecoderArgs) -> nn.Module:
    scaling = args.rope_scaling
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("type") or scaling.get("rope_type", "default")
    if rope_type in ("default", "linear"):
        scale = 1 / scaling["factor"] if rope_type == "linear" else 1.0
        return nn.RoPE(dims, traditional=args.rope_traditional, base=args.rope_theta, scale=scale)
    if rope_type == "llama3":
        return Llama3RoPE(dims, args.rope_theta, args.rope_traditional, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


# The mask value that asks for causal attention as plain matmuls + softmax — MLX's own fallback
# formula, op for op, so bit-identical to the fused call wherever MLX itself falls back (CPU).
# For a prefill after a prompt-cache hit on CUDA: there the fused kernel builds a cuDNN graph
# per new (q, k) shape, ~66 ms on an H200, and a suffix after a hit has a new k length almost
# every time (its scores matrix is small: a short suffix against the cached prefix).
UNFUSED_CAUSAL = "unfused-causal"


def unfused_causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    B, n_heads, L, D = q.shape
    n_kv = k.shape[1]
    q = mx.array(scale, q.dtype) * q
    if n_heads != n_kv:
        q = q.reshape(B, n_kv, n_heads // n_kv, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    kL = k.shape[-2]
    offset = max(kL - L, 0)
    mask = mx.expand_dims(mx.arange(offset, offset + L), 1) >= mx.expand_dims(mx.arange(kL), 0)
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(B, n_heads, L, -1) if n_heads != n_kv else out


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = hd**-0.5
        qkv_bias = args.attention_bias or args.qkv_bias
        self.q_proj = Linear(dim, self.n_heads * hd, bias=qkv_bias)
        self.k_proj = Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = Linear(self.n_heads * hd, dim, bias=args.attention_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = make_rope(hd, args)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        queries, keys, values = self.project(x, cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        return self.output(self.attend(queries, keys, values, mask))

    # The three stages, split so a compiled decode step (CompiledDecode) can run the
    # shape-stable ones fused and only the cache update + attention eagerly.
    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        fused = self.get("_qkv")
        if fused is not None and B * L <= GEMV_MAX_ROWS and _fusion_on[0]:
            # Decode: one product over the concatenated q/k/v rows (see fuse_projections).
            qkv = linear_nt(x, fused)
            nq, nk = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
            queries, keys, values = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        else:
            queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1)
        keys = keys.reshape(B, L, self.n_kv_heads, -1)
        if self.qk_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array:
        if isinstance(mask, str) and mask == UNFUSED_CAUSAL:
            return unfused_causal_attention(queries, keys, values, self.scale)
        if cpu_attention.applies(queries, keys, mask):  # CPU float32 prefill: same bits, fewer scores
            return cpu_attention.causal_attention(queries, keys, values, self.scale)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)

    def output(self, attended: mx.array) -> mx.array:
        B, _, L, _ = attended.shape
        return self.o_proj(attended.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = Linear(hidden, dim, bias=args.mlp_bias)
        self.up_proj = Linear(dim, hidden, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        fused = self.get("_gate_up")
        if fused is not None and x.size // x.shape[-1] <= GEMV_MAX_ROWS and _fusion_on[0]:
            n = self.gate_proj.weight.shape[0]
            gate_up = linear_nt(x, fused)
            return self.down_proj(swiglu(gate_up[..., :n], gate_up[..., n:]))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


_fusion_on = [True]


class fusion_disabled:
    """Context manager: separate q/k/v and gate/up products (benchmarks' A/B)."""

    def __enter__(self) -> None:
        _fusion_on[0] = False

    def __exit__(self, *exc: Any) -> None:
        _fusion_on[0] = True


def fuse_projections(model: DecoderModel) -> bool:
    """Concatenate each layer's q/k/v weights (and gate/up) into one [rows, K] array, and make
    the per-projection weights row views of it (no extra memory). Decode then runs one product
    per group: fewer kernels per step, and the small k/v products (far below bandwidth on
    their own) ride along with q. Each output row is still its own dot product over K, and
    MLX's gemv computes rows independently, so B = 1 results are unchanged; prefill keeps the
    separate products (the views). Only plain bias-free bf16/fp16 layers; idempotent."""
    fused_any = False
    for layer in model.layers:
        groups = (
            (layer.self_attn, "_qkv", ("q_proj", "k_proj", "v_proj")),
            (layer.mlp, "_gate_up", ("gate_proj", "up_proj")),
        )
        for owner, key, names in groups:
            mods = [owner[n] for n in names]
            if owner.get(key) is not None or not all(
                type(m) is Linear and "bias" not in m and m.weight.dtype in (mx.bfloat16, mx.float16) for m in mods
            ):
                continue
            if len({m.weight.shape[1] for m in mods}) != 1:
                continue
            fused = mx.concatenate([m.weight for m in mods], axis=0)
            mx.eval(fused)
            start = 0
            for m in mods:
                rows = m.weight.shape[0]
                m.weight = fused[start : start + rows]
                start += rows
            owner[key] = fused
            fused_any = True
        mx.eval(layer.parameters())
    if fused_any and not _fusion_checks_out(model.layers[0]):
        for layer in model.layers:  # back to separate products (the views stay valid weights)
            for owner, key in ((layer.self_attn, "_qkv"), (layer.mlp, "_gate_up")):
                if owner.get(key) is not None:
                    del owner[key]
        log.warning("fused decode projections disabled: they did not match the separate products")
        return False
    return fused_any


def _fusion_checks_out(layer: DecoderLayer) -> bool:
    """The fused products against the separate ones on layer 0: exactly equal for one row (the
    B = 1 path must stay mlx-lm's), close for several."""
    try:
        for owner, key, names in (
            (layer.self_attn, "_qkv", ("q_proj", "k_proj", "v_proj")),
            (layer.mlp, "_gate_up", ("gate_proj", "up_proj")),
        ):
            fused = owner.get(key)
            if fused is None:
                continue
            for rows in (1, 4):
                x = mx.random.normal((rows, fused.shape[1]), key=mx.random.key(rows)).astype(fused.dtype)
                together = linear_nt(x, fused)
                apart = mx.concatenate([owner[n](x) for n in names], axis=-1)
                if rows == 1 and not mx.array_equal(together, apart).item():
                    return False
                scale = max(1.0, mx.abs(apart.astype(mx.float32)).max().item())
                if mx.abs(together.astype(mx.float32) - apart.astype(mx.float32)).max().item() > 0.02 * scale:
                    return False
        return True
    except Exception as e:  # noqa: BLE001
        log.warning("fused projection check failed: %s", e)
        return False


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    # CompiledDecode's stages: the same ops as __call__, in the same order.
    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(x), offset)

    def finish(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.self_attn.output(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, tokens: mx.array, caches: list[Any], unfused_attention: bool = False) -> mx.array:
        h = self.embed_tokens(tokens)
        mask = UNFUSED_CAUSAL if unfused_attention and h.shape[1] > 1 else caches[0].make_mask(h.shape[1])
        for layer, cache in zip(self.layers, caches):
            h = layer(h, mask, cache)
        return self.norm(h)


class DecoderModel(nn.Module):
    """`hidden = model(tokens, caches)`; `logits = model.logits(hidden)`.

    The LM head is separate so callers project only the positions they sample from (a prefill
    chunk never materializes an [L, vocab] transient).
    """

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, caches: list[Any], *, unfused_attention: bool = False) -> mx.array:
        """`unfused_attention`: causal attention as matmuls (UNFUSED_CAUSAL), for a prefill."""
        return self.model(tokens, caches, unfused_attention)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            embed = self.model.embed_tokens
            if type(embed) is nn.Embedding:
                return linear_nt(hidden, embed.weight)
            return embed.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        a = self.args
        return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * dtype_bytes


def head_dim_of(raw: dict[str, Any]) -> int:
    return int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])


def default_theta(raw: dict[str, Any], fallback: float) -> float:
    theta = raw.get("rope_theta")
    return float(theta) if theta is not None and not math.isnan(float(theta)) else fallback


def _structure(layer: nn.Module) -> tuple:
    """Everything about a layer that is not an array (bits, group sizes, head counts, RoPE
    settings): the traced graph bakes these in, so layers share compiled stages only when equal."""
    out = []
    for name, module in layer.named_modules():
        plain = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if k not in ("_training", "_no_grad") and isinstance(v, (bool, int, float, str, type(None), tuple))
        )
        out.append((name, type(module).__name__, tuple(plain)))
    return tuple(out)


def _fusion_wanted() -> bool:
    """Fused projections on CUDA only (where kernel count and small-product efficiency are the
    bottleneck). On by default since measured on an H200 (docs/performance.md: B=1 greedy tokens
    identical to mlx-lm, 8B decode +8% at B=1 and +20% at B=8); MLX_TRIO_FUSE=0 turns it off."""
    try:
        return (
            os.environ.get("MLX_TRIO_FUSE", "1") != "0"
            and mx.default_device().type == mx.gpu
            and hasattr(mx, "cuda")
            and mx.cuda.is_available()
        )
    except Exception:  # noqa: BLE001
        return False


def _layer_inputs(layer: DecoderLayer) -> dict:
    """What a compiled stage takes per layer: its parameters and its fused weights."""
    fused = {}
    for owner, key in ((layer.self_attn, "_qkv"), (layer.mlp, "_gate_up")):
        if owner.get(key) is not None:
            fused[key] = owner[key]
    return {"p": layer.parameters(), "f": fused}


def _dense_weights(model: DecoderModel) -> list[mx.array]:
    """One of each distinct dense (bias-free) projection weight a decode step multiplies by."""
    out: dict[tuple[int, ...], mx.array] = {}
    layer = model.layers[0] if model.layers else None
    mods = (
        []
        if layer is None
        else [
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ]
    )
    if not model.args.tie_word_embeddings:
        mods.append(model.lm_head)
    weights = [m["weight"] for m in mods if type(m) is Linear and "bias" not in m]
    weights += [
        o[k]
        for o, k in ((layer.self_attn, "_qkv"), (layer.mlp, "_gate_up"))
        if layer is not None and o.get(k) is not None
    ]
    if model.args.tie_word_embeddings and type(model.model.embed_tokens) is nn.Embedding:
        weights.append(model.model.embed_tokens.weight)
    for w in weights:
        out.setdefault(tuple(w.shape), w)
    return list(out.values())


class CompiledDecode:
    """One decode forward (L == 1) whose shape-stable stages run as compiled, fused graphs.

    A decode step is host-bound on small models: building the graph op by op in Python costs
    more than the device needs to run it. Per layer, everything except the KV-cache update and
    the attention itself has shapes that do not change from step to step (only the KV length
    grows), so it is compiled once per batch size: [embed + layer 0's projections], then per
    layer [o_proj + residual + MLP + residual + the next layer's norm, q/k/v, q/k norms, RoPE],
    then [final norm + LM head]. The cache update and scaled_dot_product_attention stay eager
    (their shapes grow every step). The ops and their order are exactly `DecoderModel.__call__`'s,
    so results are identical to the eager graph.

    One compiled function serves every layer: layer weights are inputs, not constants, and
    a template layer (layer 0, restored afterwards) is re-pointed at them while tracing. That
    needs every layer to have the same structure (same quantization, say); otherwise
    `enabled` is False and the caller uses the eager forward.
    """

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        layers = model.layers
        self.enabled = bool(layers) and len({_structure(layer) for layer in layers}) == 1
        if layers and _fusion_wanted():
            fuse_projections(model)
        self._params = [_layer_inputs(layer) for layer in layers]
        self._template = layers[0] if layers else None
        # Settle the GEMV choices eagerly (self-check, per-shape timing): nothing can be timed
        # or checked inside a trace.
        self.gemv_report = tune_gemv(_dense_weights(model)) if _gemv_kernel() is not None else {}
        self._offset_host: int | None = None
        self._offset_dev: mx.array | None = None
        self._first = mx.compile(self._first_fn)
        self._mid = mx.compile(self._mid_fn)
        self._last = mx.compile(self._last_fn)

    def _as(self, params: dict) -> DecoderLayer:
        t = self._template
        t.update(params["p"])
        for owner, key in ((t.self_attn, "_qkv"), (t.mlp, "_gate_up")):
            if key in params["f"]:
                owner[key] = params["f"][key]
        return t

    def _restore(self) -> None:
        self._as(self._params[0])

    def _first_fn(self, p0: dict, tokens: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        try:
            h = self.model.model.embed_tokens(tokens)
            return (h, *self._as(p0).project(h, offset))
        finally:
            self._restore()

    def _mid_fn(self, pa: dict, pb: dict, x: mx.array, attended: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        try:
            h = self._as(pa).finish(x, attended)
            return (h, *self._as(pb).project(h, offset))
        finally:
            self._restore()

    def _last_fn(self, p: dict, x: mx.array, attended: mx.array) -> mx.array:
        try:
            h = self.model.model.norm(self._as(p).finish(x, attended))
            return self.model.logits(h[:, -1, :])
        finally:
            self._restore()

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        """tokens [B, 1] → logits [B, vocab]; updates `caches` like `DecoderModel.__call__`."""
        mask = caches[0].make_mask(1)
        offset = caches[0].offset
        if isinstance(offset, int):
            # A solo row's position as a device scalar, advanced on the device from step to step
            # (no host-to-device upload per step); rebuilt only when the position jumps.
            host = offset
            if self._offset_host != host:
                self._offset_dev = mx.array(host, dtype=mx.int32)
            offset = self._offset_dev
            self._offset_host, self._offset_dev = host + 1, offset + 1
        params, layers = self._params, self.model.layers
        h, q, k, v = self._first(params[0], tokens, offset)
        last = len(caches) - 1
        for i, cache in enumerate(caches):
            keys, values = cache.update_and_fetch(k, v)
            attended = layers[i].self_attn.attend(q, keys, values, mask)
            if i == last:
                return self._last(params[i], h, attended)
            h, q, k, v = self._mid(params[i], params[i + 1], h, attended, offset)
        raise AssertionError("unreachable")
