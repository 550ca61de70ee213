"""Qwen2.5-VL: the Qwen2 decoder with multimodal RoPE (model/vision/mrope.py) and a vision tower
(model/vision/qwen2_5_vl.py) whose features replace the prompt's image-pad embeddings.

Op for op as mlx-vlm's qwen2_5_vl language model: greedy tokens equal its generate on the same
weights. Text-only rows run at position = cache offset (+ the row's delta after an image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from model.engine.rows import ImageInput
from model.families.common import tie_embeddings
from model.kernels.unfused_attention import UNFUSED_CAUSAL
from model.kv.cache import LayerCache
from model.media import KindLayout, MediaLayout
from model.nn.decoder import MLP, Attention, DecoderArgs
from model.nn.language_model import AfterLayer, LanguageModel
from model.vision import mrope
from model.vision.qwen2_5_vl import VisionArgs, VisionTower

MODEL_TYPES: tuple[str, ...] = ("qwen2_5_vl",)


class MRopeAttention(Attention):
    def attend_mrope(self, x: mx.array, mask: Any, cache: LayerCache, cos: mx.array, sin: mx.array) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = mrope.rotate(q, cos, sin), mrope.rotate(k, cos, sin)
        return self.output(self.attend_cached(q, k, v, mask, cache))


class MRopeLayer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.self_attn = MRopeAttention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.self_attn.attend_mrope(self.input_layernorm(x), mask, cache, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextBody(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [MRopeLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Qwen25VLModel(LanguageModel):
    media_kinds = frozenset({"image"})

    def __init__(self, args: DecoderArgs, vision: VisionArgs, sections: Sequence[int], ids: dict[str, int]):
        super().__init__()
        self.args = args
        self.model = TextBody(args)
        self.visual = VisionTower(vision)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.image_token_id = ids["image_token_id"]
        self.vision_start_token_id = ids["vision_start_token_id"]
        self.vision_end_token_id = ids["vision_end_token_id"]
        self._inv_freq = 1.0 / (args.rope_theta ** (mx.arange(0, args.head_dim, 2).astype(mx.float32) / args.head_dim))
        self._selector = mrope.section_selector(sections, args.head_dim // 2)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
        delta: int | mx.array = 0,
    ) -> mx.array:
        """`embeddings` ([B, L, hidden]) replace the token lookup (a prompt with images, from
        `embed_with_images`); `positions` ([3, B, L]) its mrope positions; otherwise a row runs at
        cache offset + `delta` (the row's `rope_index` delta once an image came before)."""
        h = self.model.embed_tokens(tokens) if embeddings is None else embeddings
        B, L = h.shape[0], h.shape[1]
        if positions is None:
            offset = mx.array(caches[0].offset) + mx.array(delta)
            start = offset.reshape(-1, 1) if offset.ndim else offset.reshape(1, 1)
            positions = mx.broadcast_to(start + mx.arange(L), (3, B, L))
        cos, sin = mrope.cos_sin(positions, self._inv_freq, self._selector, h.dtype)
        mask = UNFUSED_CAUSAL if unfused_attention and L > 1 else caches[0].make_mask(L)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, mask, cache, cos, sin)
            if after_layer is not None:
                after_layer(i, h)
        return self.model.norm(h)

    def media_token_ids(self) -> dict[str, int]:
        return {"image": self.image_token_id}

    def media_layout(self) -> MediaLayout:
        vs, ve = self.vision_start_token_id, self.vision_end_token_id
        return MediaLayout((("image", KindLayout((vs, self.image_token_id, ve), self.image_token_id, (vs,), (ve,))),))

    def encode_images(self, pixel_values: mx.array, grid_thw: Sequence[tuple[int, int, int]]) -> mx.array:
        """Preprocessed patches of one or more images -> one feature row per image-pad token."""
        return self.visual(pixel_values, list(grid_thw))

    def encode_media(self, items: Sequence[ImageInput]) -> mx.array:
        """A row's images (model/engine/image_rows.py) -> their features, in order: one tower call."""
        return self.encode_images(mx.array(np.concatenate([i.pixels for i in items])), [i.grid_thw for i in items])

    def embed_with_images(self, tokens: mx.array, image_features: mx.array) -> mx.array:
        """[1, L] tokens -> [1, L, hidden] embeddings whose image-pad rows are the features, in order."""
        h = self.model.embed_tokens(tokens)
        is_image = tokens == self.image_token_id
        count = int(np.asarray(is_image).sum())
        if count != image_features.shape[0]:
            raise ValueError(f"{count} image-pad tokens but {image_features.shape[0]} image features")
        if count == 0:
            return h
        index = mx.where(is_image, mx.cumsum(is_image.astype(mx.int32), axis=-1) - 1, 0)
        return mx.where(mx.expand_dims(is_image, -1), image_features[index].astype(h.dtype), h)

    def image_positions(self, tokens: Sequence[int], grid_thw: Sequence[tuple[int, int, int]]) -> tuple[mx.array, int]:
        """[3, 1, L] mrope positions of a prompt with these images, and the row's delta after it."""
        positions, delta = mrope.rope_index(
            tokens, (self.image_token_id,), grid_thw, self.visual.args.spatial_merge_size
        )
        return mx.array(positions)[:, None, :], delta

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def layers(self) -> list[MRopeLayer]:
        return self.model.layers

    @property
    def attention_heads(self) -> int:
        return self.args.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.args.kv_bytes_per_token(dtype_bytes)

    def activation_dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Newer transformers save `model.language_model.*` and `model.visual.*`.
        renamed = {}
        for k, v in weights.items():
            if k.startswith("model.visual."):
                k = k[len("model.") :]
            elif k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model.") :]
            if "rotary_emb.inv_freq" not in k:
                renamed[k] = v
        if self.args.tie_word_embeddings:
            renamed.pop("lm_head.weight", None)
        return self.visual.sanitize(renamed, "visual.")


def build(config: dict[str, Any], has_lm_head: bool) -> Qwen25VLModel:
    text = {**config, **(config.get("text_config") or {})}
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    scaling = text.get("rope_scaling") or {}
    head_dim = hidden // heads
    sections = [int(s) for s in scaling.get("mrope_section") or (head_dim // 2, 0, 0)]
    if sum(sections) != head_dim // 2:
        raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {head_dim // 2}")
    args = DecoderArgs(
        hidden_size=hidden,
        num_hidden_layers=int(text["num_hidden_layers"]),
        intermediate_size=int(text["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=float(text.get("rope_theta", 1000000.0)),
        max_position_embeddings=int(text.get("max_position_embeddings") or 128000),
        qkv_bias=True,
        tie_word_embeddings=tie_embeddings(text, has_lm_head, default=True),
    )
    ids = {
        "image_token_id": int(config.get("image_token_id", 151655)),
        "vision_start_token_id": int(config.get("vision_start_token_id", 151652)),
        "vision_end_token_id": int(config.get("vision_end_token_id", 151653)),
    }
    return Qwen25VLModel(args, VisionArgs.from_config(config["vision_config"], hidden), sections, ids)
