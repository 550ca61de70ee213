"""Qwen3.5 (model_type qwen3_5) as its checkpoints ship it: with its vision tower (`vision_config`)
for images and videos; a text-only checkpoint is model/families/qwen3_5.py's model.

Qwen3-VL's vision tower (model/vision/qwen3_vl.py) whose features replace the prompt's image and
video pad embeddings, and interleaved multimodal RoPE (model/vision/mrope.py) for the prefill of a
prompt with images or videos, op for op as mlx-vlm's qwen3_5. Every other forward (text rows,
decode steps) turns at cache offset + the row's delta with the text model's RoPE, so text rows
keep mlx-lm's numerics. A video is one run of pad tokens per temporal patch (two frames), the
frame's timestamp in text before it (Qwen3-VL's processor), each run positioned as an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from model.engine.rows import ImageInput
from model.families import qwen3_5
from model.families.qwen3_5 import Attention, HybridArgs, Qwen35Model
from model.kernels.unfused_attention import UNFUSED_CAUSAL
from model.kv.cache import LayerCache
from model.media import KindLayout, MediaLayout
from model.nn.language_model import AfterLayer
from model.vision import mrope
from model.vision.qwen3_vl import VisionArgs, VisionTower

MODEL_TYPES: tuple[str, ...] = ("qwen3_5",)  # (a text-only checkpoint: qwen3_5.build's model)


class MRopeAttention(Attention):
    """Qwen3.5's attention turned by multimodal (cos, sin) when given, else at cache offset + delta."""

    def __call__(self, x: mx.array, mask: Any, cache: LayerCache, rope: Any = None, delta: Any = 0) -> mx.array:
        if rope is None and isinstance(delta, int) and delta == 0:
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        queries, gate = self.q_proj(x), None
        if self.output_gate:
            queries, gate = mx.split(queries.reshape(B, L, self.n_heads, -1), 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        queries = self.q_norm(queries.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if rope is not None:
            queries, keys = mrope.rotate_prefix(queries, keys, *rope)
        else:
            queries, keys = (
                self.rope(queries, offset=cache.offset + delta),
                self.rope(keys, offset=cache.offset + delta),
            )
        out = cache.attend(queries, keys, values, self.scale, mask, self.attend)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate))


class Qwen35VLModel(Qwen35Model):
    """Qwen3.5 with Qwen3-VL's vision tower: images and videos (each frame's features at a run of
    its pad token, in prompt order), and their prompts' multimodal RoPE positions."""

    def __init__(self, args: HybridArgs, vision: VisionArgs, sections: Sequence[int], ids: dict[str, int]):
        super().__init__(args)
        for layer in self.layers:  # (set by key: the attention HybridLayer built was never evaluated)
            if not layer.is_linear:
                layer["self_attn"] = MRopeAttention(args)
        self.visual = VisionTower(vision)
        self.media_kinds = frozenset({"image", "video"})
        self.image_token_id, self.video_token_id = ids["image_token_id"], ids["video_token_id"]
        self.vision_start_token_id, self.vision_end_token_id = ids["vision_start_token_id"], ids["vision_end_token_id"]
        dims, theta = args.rotary_dims, args.base.rope_theta
        self._inv_freq = 1.0 / (theta ** (mx.arange(0, dims, 2).astype(mx.float32) / dims))
        self._selector = mrope.section_selector(sections, dims // 2, interleaved=True)

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
        `embed_with_images`) and `positions` ([3, B, L]) are its multimodal RoPE positions;
        otherwise a row runs at cache offset + `delta` (its `rope_index` delta after an image)."""
        body = self.model
        h = body.embed_tokens(tokens) if embeddings is None else embeddings
        rope = None
        if positions is not None:
            freqs = mx.take(positions, self._selector, axis=0).transpose(1, 2, 0).astype(mx.float32) * self._inv_freq
            emb = mx.concatenate([freqs, freqs], axis=-1)
            rope = (mx.cos(emb).astype(h.dtype), mx.sin(emb).astype(h.dtype))
        L, first = h.shape[1], self._first_attention
        mask = None if first is None else UNFUSED_CAUSAL if unfused_attention and L > 1 else caches[first].make_mask(L)
        for i, (layer, cache) in enumerate(zip(body.layers, caches)):
            if layer.is_linear:
                h = h + layer.linear_attn(layer.input_layernorm(h), None, cache)
            else:
                attention: Any = layer.self_attn  # (an MRopeAttention: __init__ set it)
                h = h + attention(layer.input_layernorm(h), mask, cache, rope, delta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if after_layer is not None:
                after_layer(i, h)
        return body.norm(h)

    def media_token_ids(self) -> dict[str, int]:
        return {"image": self.image_token_id, "video": self.video_token_id}

    def media_layout(self) -> MediaLayout:
        """Qwen3-VL's processor: an image's pads between vision start and end; a video's runs each
        so, after its frame pair's time ("<1.5 seconds>")."""
        vs, ve, image, video = (
            self.vision_start_token_id,
            self.vision_end_token_id,
            self.image_token_id,
            self.video_token_id,
        )
        return MediaLayout(
            (
                ("image", KindLayout((vs, image, ve), image, (vs,), (ve,))),
                ("video", KindLayout((vs, video, ve), video, (vs,), (ve,), "<{seconds:.1f} seconds>")),
            )
        )

    def encode_images(self, pixel_values: mx.array, grid_thw: Sequence[tuple[int, int, int]]) -> mx.array:
        """Preprocessed patches of images and videos -> one feature row per pad token, in order."""
        return self.visual(pixel_values, list(grid_thw))

    def encode_media(self, items: Sequence[ImageInput]) -> mx.array:
        """A row's images and videos (model/engine/image_rows.py) -> their features, in order: one
        tower call (each frame attends within itself)."""
        return self.encode_images(mx.array(np.concatenate([i.pixels for i in items])), [i.grid_thw for i in items])

    def embed_with_images(self, tokens: mx.array, image_features: mx.array) -> mx.array:
        """[1, L] tokens -> [1, L, hidden] embeddings whose image and video pad rows are the
        features, in order."""
        h = self.model.embed_tokens(tokens)
        is_media = (tokens == self.image_token_id) | (tokens == self.video_token_id)
        count = int(np.asarray(is_media).sum())
        if count != image_features.shape[0]:
            raise ValueError(f"{count} image-pad tokens but {image_features.shape[0]} image features")
        if count == 0:
            return h
        index = mx.where(is_media, mx.cumsum(is_media.astype(mx.int32), axis=-1) - 1, 0)
        return mx.where(mx.expand_dims(is_media, -1), image_features[index].astype(h.dtype), h)

    def image_positions(self, tokens: Sequence[int], grid_thw: Sequence[tuple[int, int, int]]) -> tuple[mx.array, int]:
        """[3, 1, L] positions of a prompt whose pad runs have these grids (a video's one (1, h, w)
        per temporal patch), and the row's delta after it."""
        pads = (self.image_token_id, self.video_token_id)
        positions, delta = mrope.rope_index(tokens, pads, grid_thw, self.visual.args.spatial_merge_size)
        return mx.array(positions)[:, None, :], delta

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The text model's keys as Qwen3.5's, the tower's as `visual.*` (Hugging Face's
        `model.visual.*`, mlx-vlm's `vision_tower.*`)."""
        visual: dict[str, mx.array] = {}
        text: dict[str, mx.array] = {}
        for key, value in weights.items():
            for prefix in ("model.visual.", "visual.", "vision_tower."):
                if key.startswith(prefix):
                    visual["visual." + key[len(prefix) :]] = value
                    break
            else:
                text[key] = value
        if not visual:  # a text-only conversion of a vision checkpoint (mlx-lm's): serve it as text
            self.pop("visual")
            self.media_kinds = frozenset()
            return super().sanitize(text)
        return {**super().sanitize(text), **self.visual.sanitize(visual, "visual.")}


def build(config: dict[str, Any], has_lm_head: bool) -> Qwen35Model:
    if not config.get("vision_config"):
        return qwen3_5.build(config, has_lm_head)
    text = config.get("text_config") or config
    if int(text.get("num_experts") or 0) > 0:
        raise ValueError("Qwen3.5 mixture-of-experts checkpoints are model_type qwen3_5_moe")
    args = qwen3_5.hybrid_args(text, has_lm_head)
    rope = text.get("rope_parameters") or {}
    sections = [int(s) for s in rope.get("mrope_section") or (11, 11, 10)]
    if sum(sections) != args.rotary_dims // 2:
        raise ValueError(f"mrope_section {sections} must sum to the rotary dims / 2 = {args.rotary_dims // 2}")
    ids = {
        "image_token_id": int(config.get("image_token_id", 248056)),
        "video_token_id": int(config.get("video_token_id", 248057)),
        "vision_start_token_id": int(config.get("vision_start_token_id", 248045)),
        "vision_end_token_id": int(config.get("vision_end_token_id", 248046)),
    }
    vision = VisionArgs.from_config(config["vision_config"], args.base.hidden_size)
    return Qwen35VLModel(args, vision, sections, ids)
