"""The pre-norm SwiGLU decoder that Llama, Mistral and Qwen 2/3 are variants of.

Parameter names follow Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...), so
weights load by name. The op sequence mirrors mlx-lm's llama/qwen2/qwen3 modules exactly: greedy
outputs must be token-identical to `mlx_lm.generate` on the same weights.

Families (model/families/) translate a config.json into `DecoderArgs` and build a `DecoderModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.kernels import cpu_attention, cpu_swiglu, unfused_attention
from model.kernels.unfused_attention import UNFUSED_CAUSAL
from model.kv.cache import LayerCache
from model.lora.delta import fused_product
from model.nn.language_model import AfterLayer, Capabilities, LanguageModel

# A decode step of at most this many rows multiplies by a layer's fused q/k/v (and gate/up)
# weights where model/nn/fused_projections.py made them; wider products keep the separate ones.
FUSED_MAX_ROWS = 8
# Where the fused weights live on their owner module (absent: not fused).
FUSED_QKV = "_qkv"
FUSED_GATE_UP = "_gate_up"


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

    def kv_bytes_per_token(self, dtype_bytes: int, layers: int | None = None) -> int:
        """Keys and values of one position in `layers` attention layers (default: every layer)."""
        count = self.num_hidden_layers if layers is None else layers
        return 2 * count * self.num_key_value_heads * self.head_dim * dtype_bytes


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    # On the CPU, float32: the same bits from a faster exp (model/kernels/cpu_swiglu.py).
    if cpu_swiglu.applies(gate, x):
        return cpu_swiglu.swiglu(gate, x)
    return _swiglu(gate, x)


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


class ProportionalRoPE(nn.Module):
    """mlx-lm's "proportional" RoPE (Gemma 4): the frequencies of all `dims`, but only the first
    `partial_rotary_factor` of them turn (the rest get infinite wavelengths)."""

    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict[str, Any]):
        super().__init__()
        self.dims, self.traditional = dims, traditional
        rotated = int(dims * scaling.get("partial_rotary_factor", 1.0))
        exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
        factor = scaling.get("factor", 1.0)
        self._freqs = mx.concatenate([factor * (base**exponents), mx.full(((dims - rotated) // 2,), mx.inf)])

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")


def make_rope(dims: int, args: DecoderArgs) -> nn.Module:
    return rope_for(dims, args.rope_theta, args.rope_traditional, args.rope_scaling)


def rope_for(dims: int, base: float, traditional: bool, scaling: dict[str, Any] | None) -> nn.Module:
    """RoPE on `base` of the `rope_scaling` dict's type (None: plain)."""
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("type") or scaling.get("rope_type", "default")
    if rope_type == "default":
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1.0)
    if rope_type == "linear":
        assert scaling is not None
        return nn.RoPE(dims, traditional=traditional, base=base, scale=1 / scaling["factor"])
    if rope_type == "llama3":
        assert scaling is not None
        return Llama3RoPE(dims, base, traditional, scaling)
    if rope_type == "proportional":
        assert scaling is not None
        return ProportionalRoPE(dims, base, traditional, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = hd**-0.5
        qkv_bias = args.attention_bias or args.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=args.attention_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = make_rope(hd, args)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
        queries, keys, values = self.project(x, cache.offset)
        return self.output(self.attend_cached(queries, keys, values, mask, cache))

    def attend_cached(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any, cache: LayerCache
    ) -> mx.array:
        """Store the step's keys and values in `cache`, then attend over everything it holds."""
        return cache.attend(queries, keys, values, self.scale, mask, self.attend)

    # The three stages, split so a compiled decode step (model/engine/compiled_decode.py) can run the
    # shape-stable ones fused and only the cache update + attention eagerly.
    def project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        # Decode: one product over the concatenated q/k/v rows (model/nn/fused_projections.py).
        qkv = fused_product(self, FUSED_QKV, x, FUSED_MAX_ROWS)
        if qkv is not None:
            head_dim = qkv.shape[-1] // (self.n_heads + 2 * self.n_kv_heads)
            nq, nk = self.n_heads * head_dim, self.n_kv_heads * head_dim
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
            return unfused_attention.unfused_causal_attention(queries, keys, values, self.scale)
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
        self.gate_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = fused_product(self, FUSED_GATE_UP, x, FUSED_MAX_ROWS)
        if gate_up is not None:
            n = gate_up.shape[-1] // 2
            return self.down_proj(swiglu(gate_up[..., :n], gate_up[..., n:]))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
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

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        h = self.embed_tokens(tokens)
        mask = UNFUSED_CAUSAL if unfused_attention and h.shape[1] > 1 else caches[0].make_mask(h.shape[1])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, mask, cache)
            if after_layer is not None:
                after_layer(i, h)
        return self.norm(h)


class DecoderModel(LanguageModel):
    # The shared decoder's blocks are the ones the compiled decode, the fused projections and
    # tensor parallelism are written for.
    capabilities = Capabilities(compiled_decode=True, fused_projections=True, sharding=True)

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        return self.model(tokens, caches, unfused_attention, after_layer)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def attention_heads(self) -> int:
        return self.args.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.args.kv_bytes_per_token(dtype_bytes)

    def activation_dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
