"""Qwen3.5 (text): gated-delta linear-attention layers (model/nn/gated_delta.py) with a full-attention
layer every `full_attention_interval`-th (or where `layer_types` says "full_attention").

Its own blocks, op for op as mlx-lm's qwen3_5 (greedy tokens equal mlx_lm.generate's): full
attention is Qwen3's with q/k norms, RoPE over `partial_rotary_factor` of each head, and an
output gate (q_proj yields queries and a sigmoid gate per head). Linear layers keep a fixed-size
`StateCache` (model/kv/state.py), attention layers a `KVCache`. Admission bills only the attention
layers per token (`kv_bytes_per_token`); a row's fixed state is `state_bytes_per_row`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.families.common import head_dim_of, tie_embeddings
from model.kernels import cpu_attention, unfused_attention
from model.kernels.unfused_attention import UNFUSED_CAUSAL
from model.kv.cache import KVCache, LayerCache, SoloCache
from model.kv.state import StateCache
from model.nn.decoder import MLP, DecoderArgs
from model.nn.gated_delta import DeltaArgs, GatedDeltaNet
from model.nn.language_model import AfterLayer, Capabilities, LanguageModel

MODEL_TYPES: tuple[str, ...] = ("qwen3_5",)


@attrs.frozen
class HybridArgs:
    base: DecoderArgs  # shapes of the attention layers and MLPs, tying
    delta: DeltaArgs
    linear: tuple[bool, ...]  # per layer: a gated delta net (else full attention)
    rotary_dims: int
    output_gate: bool = True


class Attention(nn.Module):
    def __init__(self, args: HybridArgs):
        super().__init__()
        a = args.base
        dim, hd = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv_heads, self.output_gate = a.num_attention_heads, a.num_key_value_heads, args.output_gate
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd * (2 if args.output_gate else 1), bias=a.attention_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=a.attention_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=a.attention_bias)
        self.q_norm = nn.RMSNorm(hd, eps=a.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=a.rms_norm_eps)
        scaling = a.rope_scaling or {}
        scale = 1 / scaling["factor"] if (scaling.get("type") or scaling.get("rope_type")) == "linear" else 1.0
        self.rope = nn.RoPE(args.rotary_dims, traditional=False, base=a.rope_theta, scale=scale)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x)
        gate = None
        if self.output_gate:
            queries, gate = mx.split(queries.reshape(B, L, self.n_heads, -1), 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        queries = self.q_norm(queries.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.rope(queries, offset=cache.offset), self.rope(keys, offset=cache.offset)
        out = cache.attend(queries, keys, values, self.scale, mask, self.attend)  # (a quantized one its own way)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any) -> mx.array:
        if isinstance(mask, str) and mask == UNFUSED_CAUSAL:
            return unfused_attention.unfused_causal_attention(queries, keys, values, self.scale)
        if cpu_attention.applies(queries, keys, mask):  # CPU float32 prefill: same bits, fewer scores
            return cpu_attention.causal_attention(queries, keys, values, self.scale)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)


class HybridLayer(nn.Module):
    def __init__(self, args: HybridArgs, layer: int):
        super().__init__()
        self.is_linear = args.linear[layer]
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args.delta)
        else:
            self.self_attn = Attention(args)
        self.mlp = MLP(args.base)
        self.input_layernorm = nn.RMSNorm(args.base.hidden_size, eps=args.base.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.base.hidden_size, eps=args.base.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridBody(nn.Module):
    def __init__(self, args: HybridArgs):
        super().__init__()
        a = args.base
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [HybridLayer(args, i) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class Qwen35Model(LanguageModel):
    # Recurrent states cannot take drafts back; its own blocks take none of the decoder's paths.
    capabilities = Capabilities(speculation=False)

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.args = args
        self.model = HybridBody(args)
        if not args.base.tie_word_embeddings:
            self.lm_head = nn.Linear(args.base.hidden_size, args.base.vocab_size, bias=False)
        self._first_attention = next((i for i, lin in enumerate(args.linear) if not lin), None)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        body = self.model
        h = body.embed_tokens(tokens)
        L = h.shape[1]
        mask: Any = None
        if self._first_attention is not None:  # the attention layers' mask (linear layers take none)
            mask = UNFUSED_CAUSAL if unfused_attention and L > 1 else caches[self._first_attention].make_mask(L)
        for i, (layer, cache) in enumerate(zip(body.layers, caches)):
            h = layer(h, None if layer.is_linear else mask, cache)
            if after_layer is not None:
                after_layer(i, h)
        return body.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.base.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def layers(self) -> list[HybridLayer]:
        return self.model.layers

    @property
    def attention_heads(self) -> int:
        return self.args.base.num_attention_heads

    def make_caches(self) -> list[SoloCache]:
        return [StateCache() if lin else KVCache() for lin in self.args.linear]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.args.base.kv_bytes_per_token(dtype_bytes, layers=self.args.linear.count(False))

    def state_bytes_per_row(self, dtype_bytes: int) -> int:
        return sum(layer.linear_attn.state_bytes(dtype_bytes) for layer in self.layers if layer.is_linear)

    def activation_dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """mlx-lm's: the text model's keys of a vision-language checkpoint, no MTP head, conv
        weights as MLX lays them out; a Hugging Face checkpoint (conv not yet moved) stores its
        RMSNorm weights as offsets from 1."""
        out: dict[str, mx.array] = {}
        for key, value in weights.items():
            if key.startswith(("vision_tower", "model.visual")) or "mtp." in key:
                continue
            key = key.replace("model.language_model.", "model.").replace("language_model.", "")
            out[key] = value
        if self.args.base.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        hf_layout = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in out.items())
        norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight")
        for key, value in out.items():
            if "conv1d.weight" in key and value.shape[-1] != 1:
                out[key] = value.moveaxis(2, 1)
            elif hf_layout and value.ndim == 1 and key.endswith((*norms, ".q_norm.weight", ".k_norm.weight")):
                out[key] = value + 1.0
        return out


def linear_layers(config: dict[str, Any], n: int) -> tuple[bool, ...]:
    types = config.get("layer_types")
    if types:
        if len(types) != n or not set(types) <= {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name {n} layers as linear_attention or full_attention")
        return tuple(t == "linear_attention" for t in types)
    interval = int(config.get("full_attention_interval") or 4)
    if interval < 1:
        raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
    return tuple((i + 1) % interval != 0 for i in range(n))


def build(config: dict[str, Any], has_lm_head: bool) -> Qwen35Model:
    text = config.get("text_config") or config  # a vision-language checkpoint nests the text model
    if int(text.get("num_experts") or 0) > 0:
        raise ValueError("Qwen3.5 mixture-of-experts checkpoints are model_type qwen3_5_moe")
    return Qwen35Model(hybrid_args(text, has_lm_head))


def hybrid_args(text: dict[str, Any], has_lm_head: bool) -> HybridArgs:
    """The text model's config as HybridArgs (also Qwen3.5-MoE's and Qwen3-Next's)."""
    heads, n = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    # mlx-lm reads RoPE only from rope_parameters (its defaults when absent).
    rope = dict(text.get("rope_parameters") or {"rope_theta": 100000.0, "partial_rotary_factor": 0.25})
    head_dim = head_dim_of(text)
    base = DecoderArgs(
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=n,
        intermediate_size=int(text["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=float(rope.get("rope_theta", 100000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(text.get("max_position_embeddings") or 131072),
        attention_bias=bool(text.get("attention_bias", False)),
        qk_norm=True,
        tie_word_embeddings=tie_embeddings(text, has_lm_head, default=False),
    )
    kind = rope.get("type") or rope.get("rope_type") or "default"
    if kind not in ("default", "linear", "mrope"):
        raise ValueError(f"unsupported rope type {kind!r} for qwen3_5")
    delta = DeltaArgs(
        hidden_size=base.hidden_size,
        num_v_heads=int(text["linear_num_value_heads"]),
        num_k_heads=int(text["linear_num_key_heads"]),
        head_k_dim=int(text["linear_key_head_dim"]),
        head_v_dim=int(text["linear_value_head_dim"]),
        conv_kernel=int(text.get("linear_conv_kernel_dim") or 4),
        rms_norm_eps=base.rms_norm_eps,
    )
    return HybridArgs(
        base=base,
        delta=delta,
        linear=linear_layers(text, n),
        rotary_dims=int(head_dim * float(rope.get("partial_rotary_factor", 0.25))),
        output_gate=bool(text.get("attn_output_gate", True)),
    )
