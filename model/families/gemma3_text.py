"""Gemma 3 (text): sliding-window attention in every layer but each `sliding_window_pattern`-th,
which attends globally.

Its own blocks, op for op as mlx-lm's gemma3_text (greedy tokens equal mlx_lm.generate's):
RMSNorm scaled by (1 + weight), embeddings scaled by sqrt(hidden), q/k norms, norms before and
after both the attention and the GELU-tanh MLP, local layers on their own RoPE base, global ones
on `rope_theta` with the config's scaling, scores scaled by `query_pre_attn_scalar`. Sliding
layers keep a `RotatingKVCache` of `sliding_window` positions (model/kv/rotating.py); each cache
kind builds its own mask. Admission bills every layer at full length (`kv_bytes_per_token`):
conservative, as a sliding layer never holds more than its window.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.kv.cache import KVCache, LayerCache, SoloCache
from model.kv.rotating import RotatingKVCache
from model.nn.decoder import DecoderArgs, make_rope
from model.nn.language_model import AfterLayer, LanguageModel

MODEL_TYPES: tuple[str, ...] = ("gemma3_text",)


@attrs.frozen
class GemmaArgs:
    base: DecoderArgs  # the shared shapes, global RoPE and tying
    sliding_window: int
    sliding_window_pattern: int
    rope_local_base_freq: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None = None

    def is_global(self, layer: int) -> bool:
        return layer % self.sliding_window_pattern == self.sliding_window_pattern - 1


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the stored weight is an offset from 1."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


@partial(mx.compile, shapeless=True)
def clip_residual(x: mx.array, y: mx.array) -> mx.array:
    # float16 residuals overflow in Gemma: summed in float32 and clipped (as mlx-lm does).
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Attention(nn.Module):
    def __init__(self, args: GemmaArgs, layer: int):
        super().__init__()
        a = args.base
        dim, hd = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = RMSNorm(hd, a.rms_norm_eps)
        self.k_norm = RMSNorm(hd, a.rms_norm_eps)
        local = attrs.evolve(a, rope_theta=args.rope_local_base_freq, rope_scaling=None)
        self.rope = make_rope(hd, a if args.is_global(layer) else local)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        out = cache.attend(queries, keys, values, self.scale, mask, self.attend)  # (a quantized one its own way)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: GemmaArgs, layer: int):
        super().__init__()
        a = args.base
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = clip_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return clip_residual(h, self.post_feedforward_layernorm(r))


class GemmaBody(nn.Module):
    def __init__(self, args: GemmaArgs):
        super().__init__()
        a = args.base
        self.args = args
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(args, i) for i in range(a.num_hidden_layers)]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def __call__(self, tokens: mx.array, caches: Sequence[LayerCache], after_layer: AfterLayer | None) -> mx.array:
        h = self.embed_tokens(tokens)
        h = h * mx.array(self.args.base.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        N = h.shape[1]
        # One mask per cache kind, each from its first layer's cache (all of a kind move together).
        first_global = next((i for i in range(len(caches)) if self.args.is_global(i)), None)
        global_mask = caches[first_global].make_mask(N) if first_global is not None else None
        first_local = next((i for i in range(len(caches)) if not self.args.is_global(i)), None)
        local_mask = caches[first_local].make_mask(N) if first_local is not None else None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, global_mask if self.args.is_global(i) else local_mask, cache)
            if after_layer is not None:
                after_layer(i, h)
        return self.norm(h)


class Gemma3TextModel(LanguageModel):
    def __init__(self, args: GemmaArgs):
        super().__init__()
        self.args = args
        self.model = GemmaBody(args)
        if not args.base.tie_word_embeddings:
            self.lm_head = nn.Linear(args.base.hidden_size, args.base.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,  # (ignored: the masks here are windowed)
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        return self.model(tokens, caches, after_layer)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.base.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap

    def make_caches(self) -> list[SoloCache]:
        window = self.args.sliding_window
        return [KVCache() if self.args.is_global(i) else RotatingKVCache(window) for i in range(len(self.layers))]

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    @property
    def attention_heads(self) -> int:
        return self.args.base.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # Every layer at full length: an upper bound (see the module doc).
        return self.args.base.kv_bytes_per_token(dtype_bytes)

    def activation_dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.base.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


def build(config: dict[str, Any], has_lm_head: bool) -> Gemma3TextModel:
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping is not supported")
    heads = int(config.get("num_attention_heads", 4))
    pattern = int(config.get("sliding_window_pattern", 6))
    if pattern < 1:
        raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
    cap = config.get("final_logit_softcapping")
    # Defaults are mlx-lm's (Gemma 3 1B's shapes), so both read a sparse config alike.
    base = DecoderArgs(
        hidden_size=int(config.get("hidden_size", 1152)),
        num_hidden_layers=int(config.get("num_hidden_layers", 26)),
        intermediate_size=int(config.get("intermediate_size", 6912)),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or 1),
        head_dim=int(config.get("head_dim") or 256),
        vocab_size=int(config.get("vocab_size", 262144)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta", 1_000_000.0)),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
        tie_word_embeddings=not has_lm_head,  # mlx-lm's rule: tied iff the checkpoint has no lm_head
    )
    return Gemma3TextModel(
        GemmaArgs(
            base=base,
            sliding_window=int(config.get("sliding_window", 512)),
            sliding_window_pattern=pattern,
            rope_local_base_freq=float(config.get("rope_local_base_freq", 10_000.0)),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=None if cap is None else float(cap),
        )
    )
