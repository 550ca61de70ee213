"""Gemma 4 (text), and the text part of multimodal "gemma4" checkpoints (towers dropped).

Op for op as mlx-lm's gemma4_text (greedy tokens equal mlx_lm.generate's). Over Gemma 3: plain
RMSNorms; `layer_types` name layers sliding or full; full ones have their own head dim, RoPE
(proportional: part of the dims turn) and maybe keys that are the values (`attention_k_eq_v`);
values are RMS-normalized, scores unscaled, each block scaled by its `layer_scalar`. Small models
add per-layer inputs (a token embedding per layer gating a last residual branch) and KV sharing:
the last `num_kv_shared_layers` layers attend over the KV of the last unshared layer of their
kind (model/kv/shared.py), so only unshared layers have caches. Not served, refused at load: MoE
blocks (`enable_moe_block`) and bidirectional attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.families import gemma3_text
from model.kv.cache import KVCache, LayerCache, SoloCache
from model.kv.rotating import RotatingKVCache
from model.kv.shared import KVShare, SharingAttention
from model.load.errors import ModelLoadError
from model.nn.decoder import rope_for
from model.nn.language_model import AfterLayer, LanguageModel

MODEL_TYPES: tuple[str, ...] = ("gemma4_text", "gemma4")
SLIDING, FULL = "sliding_attention", "full_attention"
# The multimodal checkpoint's towers (not served: text only).
_TOWERS = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision", "vision_embedder")
# What mlx-lm drops: quantization-aware-training clip bounds, RoPE tables.
_UNUSED = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
_ROPE: dict[str, dict[str, Any]] = {
    FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
    SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0, "rope_type": "default"},
}


@attrs.frozen
class Gemma4Args:
    """config.json's keys; the defaults are mlx-lm's (E2B's shapes), so both read a sparse config alike."""

    layer_types: tuple[str, ...]
    hidden_size: int = 1536
    intermediate_size: int = 6144
    num_attention_heads: int = 8
    head_dim: int = 256
    global_head_dim: int | None = 512
    num_key_value_heads: int = 1
    num_global_key_value_heads: int | None = None
    vocab_size: int = 262144
    vocab_size_per_layer_input: int = 262144
    hidden_size_per_layer_input: int | None = 256  # 0 / None: no per-layer inputs
    num_kv_shared_layers: int = 20
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    rope_parameters: dict[str, dict[str, Any]] | None = None  # by layer type
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = True
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True

    @property
    def first_shared(self) -> int:
        return len(self.layer_types) - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over (itself unless shared)."""
        if layer < self.first_shared:
            return layer
        return max(i for i in range(self.first_shared) if self.layer_types[i] == self.layer_types[layer])

    def head_shape(self, layer: int) -> tuple[int, int, bool]:
        """(head dim, KV heads, keys-are-values) of a layer (mlx-lm's rules)."""
        if self.layer_types[layer] == SLIDING:
            return self.head_dim, self.num_key_value_heads, False
        kv_heads = self.attention_k_eq_v and self.num_global_key_value_heads or self.num_key_value_heads
        return self.global_head_dim or self.head_dim, kv_heads, self.attention_k_eq_v

    def attention(self, layer: int) -> SharingAttention:
        hd, kv_heads, k_eq_v = self.head_shape(layer)
        params = (self.rope_parameters or _ROPE).get(self.layer_types[layer], {})
        rope = rope_for(hd, float(params.get("rope_theta", 10_000.0)), False, params)
        has_kv, eps = layer < self.first_shared, self.rms_norm_eps
        return SharingAttention(self.hidden_size, self.num_attention_heads, kv_heads, hd, has_kv, k_eq_v, eps, rope)


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * x


@partial(mx.compile, shapeless=True)
def logit_softcap(cap: float, x: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


class MLP(gemma3_text.MLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, a: Gemma4Args, layer: int):
        super().__init__()
        dim, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = a.attention(layer)
        wide = a.use_double_wide_mlp and layer >= a.first_shared > 0
        self.mlp = MLP(dim, a.intermediate_size * (2 if wide else 1))
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        if a.hidden_size_per_layer_input:
            self.per_layer_input_gate = nn.Linear(dim, a.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(a.hidden_size_per_layer_input, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(
        self, x: mx.array, mask: Any, cache: LayerCache | None, per_layer: mx.array | None, shared: KVShare | None
    ) -> tuple[mx.array, KVShare]:
        r, shared = self.self_attn(self.input_layernorm(x), mask, cache, shared)
        h = x + self.post_attention_layernorm(r)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if per_layer is not None:
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar, shared


class Body(nn.Module):
    def __init__(self, a: Gemma4Args):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a, i) for i in range(len(a.layer_types))]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        if P := a.hidden_size_per_layer_input:
            n = len(a.layer_types)
            self.embed_tokens_per_layer = nn.Embedding(a.vocab_size_per_layer_input, n * P)
            self.per_layer_model_projection = nn.Linear(a.hidden_size, n * P, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(P, eps=a.rms_norm_eps)

    def per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array:
        """[B, L, layers, P]: each layer's embedding of the tokens, mixed with a projection of `h`."""
        n, P = len(self.layers), self.per_layer_projection_norm.weight.shape[0]
        embedded = mx.unflatten(self.embed_tokens_per_layer(tokens) * P**0.5, -1, (n, P))
        projected = self.per_layer_model_projection(h) * h.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(mx.unflatten(projected, -1, (n, P)))
        return (projected + embedded) * 2.0**-0.5


class Gemma4TextModel(LanguageModel):
    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.args = args
        self.model = Body(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,  # (ignored: the masks here are windowed)
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        a, body = self.args, self.model
        h = body.embed_tokens(tokens) * a.hidden_size**0.5
        per_layer = body.per_layer_inputs(tokens, h) if a.hidden_size_per_layer_input else None
        # One mask per kind, from its first layer's cache (all of a kind move together).
        masks = {kind: caches[a.layer_types.index(kind)].make_mask(h.shape[1]) for kind in set(a.layer_types)}
        shared: list[KVShare | None] = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            src, pli = a.kv_source(i), per_layer if per_layer is None else per_layer[:, :, i, :]
            cache, kv = (caches[i], None) if src == i else (None, shared[src])
            h, shared[i] = layer(h, masks[a.layer_types[i]], cache, pli, kv)
            if after_layer is not None:
                after_layer(i, h)
        return body.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        out = self.model.embed_tokens.as_linear(hidden) if self.args.tie_word_embeddings else self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return out if cap is None else logit_softcap(cap, out)

    def make_caches(self) -> list[SoloCache]:
        """One per unshared layer (the shared ones read their source's)."""
        a = self.args
        return [KVCache() if t == FULL else RotatingKVCache(a.sliding_window) for t in a.layer_types[: a.first_shared]]

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    @property
    def attention_heads(self) -> int:
        return self.args.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # Unshared layers, sliding ones at full length: an upper bound (as Gemma 3's).
        shapes = [self.args.head_shape(i) for i in range(self.args.first_shared)]
        return sum(2 * head_dim * kv_heads * dtype_bytes for head_dim, kv_heads, _ in shapes)

    def activation_dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            bare = k.removeprefix("model.")
            if bare.startswith(_TOWERS) or any(s in k for s in _UNUSED):
                continue
            if bare.startswith("language_model."):  # the multimodal layouts: HF's, and mlx-lm's
                rest = bare.removeprefix("language_model.")
                k = rest if k.startswith("language_model.") else f"model.{rest}"
            if any(f".self_attn.{m}" in k for m in ("k_proj", "v_proj", "k_norm")):
                if int(k.split(".")[2]) >= self.args.first_shared:
                    continue  # a shared layer's own keys and values are never used
            out[k] = v
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out


def build(config: dict[str, Any], has_lm_head: bool) -> Gemma4TextModel:
    c = config
    if "text_config" in config:  # "gemma4": the text model's config is nested (mlx-lm's vocab rule)
        c = {**config["text_config"], "vocab_size": config.get("vocab_size", 262144)}
    for key in ("enable_moe_block", "use_bidirectional_attention"):
        if c.get(key) and c[key] != "vision":  # ("vision": bidirectional over image tokens only)
            raise ModelLoadError(f"gemma4: {key}={c[key]!r} is not supported")
    layers = int(c.get("num_hidden_layers", 35))
    types = c.get("layer_types")
    if types is None:  # mlx-lm's: every `sliding_window_pattern`-th layer full
        pattern = int(c.get("sliding_window_pattern", 5))
        types = ([SLIDING] * (pattern - 1) + [FULL]) * (layers // pattern + 1)
    given = {f.name: c[f.name] for f in attrs.fields(Gemma4Args) if f.name in c and f.name != "layer_types"}
    args = Gemma4Args(layer_types=tuple(types[:layers]), **given)
    if len(args.layer_types) != layers or not set(args.layer_types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {layers} layers, each {SLIDING!r} or {FULL!r}")
    if not 0 < args.first_shared <= layers or {*args.layer_types} != {*args.layer_types[: args.first_shared]}:
        raise ValueError("every KV-shared layer needs an earlier unshared layer of its kind")
    return Gemma4TextModel(args)
