"""Gemma 4's vision tower and its image preprocessing.

Images keep their aspect ratio: each is resized (bicubic) to the largest size whose 16x16 patches
fit `max_soft_tokens` x 3² and whose sides are multiples of 48, rescaled to [0, 1]. The tower embeds
each patch (a linear map of 2·(pixel - 0.5)) plus a learned embedding of its column and row,
runs a ViT whose attention turns queries and keys by the patch's 2-D position (half the head by
the column, half by the row) with RMS-normed q, k and v, then averages each 3x3 block of patches
into one soft token, scaled by √hidden; `Embedder` projects soft tokens into the text model's
width. Each image attends within itself.

Op for op as mlx-vlm's gemma4 vision module (features equal its on the same weights);
parameter names follow the checkpoint's `vision_tower.*` and `embed_vision.*`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from PIL import Image

from model.vision.header import ImageError, ImageHeader
from model.vision.preprocess import (
    RESIZED_BYTES_PER_PIXEL,
    SOURCE_BYTES_PER_PIXEL,
    SOURCE_BYTES_PER_PIXEL_DEFAULT,
    DecodeCost,
    PreparedImage,
    decode_image,
)
from model.vision.qwen3_vl import fused_attention


@attrs.frozen
class Gemma4ImageConfig:
    """processor_config.json's `image_processor` (or a flat preprocessor_config.json)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def read(cls, model_dir: Path) -> Gemma4ImageConfig:
        raw: dict[str, Any] = {}
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.exists():
                raw = json.loads(path.read_text(encoding="utf-8"))
                break
        ip, d = raw.get("image_processor") or raw, cls()
        return cls(
            patch_size=int(ip.get("patch_size", d.patch_size)),
            max_soft_tokens=int(ip.get("max_soft_tokens", d.max_soft_tokens)),
            pooling_kernel_size=int(ip.get("pooling_kernel_size", d.pooling_kernel_size)),
            rescale_factor=float(ip.get("rescale_factor", d.rescale_factor)),
            do_normalize=bool(ip.get("do_normalize", d.do_normalize)),
            image_mean=tuple(float(x) for x in ip.get("image_mean") or d.image_mean),
            image_std=tuple(float(x) for x in ip.get("image_std") or d.image_std),
        )

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The resized (height, width): Hugging Face's `get_aspect_ratio_preserving_size`."""
        p, k = self.patch_size, self.pooling_kernel_size
        max_patches = self.max_soft_tokens * k * k
        factor = math.sqrt(max_patches * p * p / (height * width))
        side = k * p
        th, tw = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        if th == 0 and tw == 0:
            raise ImageError(f"image is {width}x{height}: too small to resize")
        longest = (max_patches // (k * k)) * side
        if th == 0:
            th, tw = side, min(int(math.floor(width / height)) * side, longest)
        elif tw == 0:
            th, tw = min(int(math.floor(height / width)) * side, longest), side
        return th, tw

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        th, tw = self.size(height, width)
        return 1, th // self.patch_size, tw // self.patch_size

    def runs(self, grid: tuple[int, int, int]) -> tuple[int, ...]:
        return (grid[1] * grid[2] // self.pooling_kernel_size**2,)

    def cost(self, header: ImageHeader) -> DecodeCost:
        th, tw = self.size(header.height, header.width)
        output = th * tw * 3 * 4
        per_pixel = SOURCE_BYTES_PER_PIXEL.get(header.format, SOURCE_BYTES_PER_PIXEL_DEFAULT)
        source = header.pixels * per_pixel + (tw * header.height + th * tw) * 4
        return DecodeCost(peak=max(source, th * tw * RESIZED_BYTES_PER_PIXEL + output), output=output)

    def load(self, data: bytes, max_source_pixels: int) -> PreparedImage:
        return self.prepare(decode_image(data, max_source_pixels))

    def prepare(self, image: Image.Image) -> PreparedImage:
        """[pH * pW, p * p * 3] float32 patches (row-major, each patch's pixels then channels)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        th, tw = self.size(rgb.height, rgb.width)
        if (th, tw) != (rgb.height, rgb.width):
            rgb = rgb.resize((tw, th), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(rgb, dtype=np.float32)  # (in place from here: the bill's peak)
        pixels *= np.float32(self.rescale_factor)
        if self.do_normalize:
            pixels -= np.array(self.image_mean, np.float32)
            pixels /= np.array(self.image_std, np.float32)
        p = self.patch_size
        gh, gw = th // p, tw // p
        patches = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        return PreparedImage(np.ascontiguousarray(patches), (1, gh, gw))


@attrs.frozen
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int = 16
    position_embedding_size: int = 10240
    pooling_kernel_size: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_config(cls, v: dict[str, Any]) -> VisionArgs:
        heads = int(v.get("num_attention_heads", 12))
        return cls(
            hidden_size=int(v.get("hidden_size", 768)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_hidden_layers=int(v.get("num_hidden_layers", 16)),
            num_attention_heads=heads,
            num_key_value_heads=int(v.get("num_key_value_heads") or heads),
            head_dim=int(v.get("head_dim", 64)),
            patch_size=int(v.get("patch_size", 16)),
            position_embedding_size=int(v.get("position_embedding_size", 10240)),
            pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
            rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 100.0)),
            use_clipped_linears=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)),
        )


class ClippableLinear(nn.Module):
    """A linear whose input and output are clamped to bounds the checkpoint stores (when it clips)."""

    def __init__(self, dims: int, out: int, clip: bool = True):
        super().__init__()
        self.linear = nn.Linear(dims, out, bias=False)
        self.clip = clip
        if clip:
            inf = float("inf")
            self.input_min, self.input_max = mx.array(-inf), mx.array(inf)
            self.output_min, self.output_max = mx.array(-inf), mx.array(inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clip:
            return self.linear(x)
        return mx.clip(self.linear(mx.clip(x, self.input_min, self.input_max)), self.output_min, self.output_max)


def f32_rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm in float32 (Gemma 4's vision q/k/v norms)."""
    xf = x.astype(mx.float32)
    normed = xf * mx.rsqrt(mx.mean(xf**2, axis=-1, keepdims=True) + eps)
    return (normed if weight is None else normed * weight.astype(mx.float32)).astype(x.dtype)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_2d(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """[B, L, N, D] turned by [B, L, 2] (column, row) positions: each half of the head by one."""
    part = 2 * (x.shape[-1] // 4)
    exponents = (2.0 / part) * mx.arange(0, part // 2).astype(mx.float32)
    timescale = mx.power(base, exponents)
    out = []
    for d in range(2):
        xd = x[..., d * part : (d + 1) * part]
        angle = positions[..., d : d + 1].astype(mx.float32) / timescale
        cos = mx.expand_dims(mx.concatenate([mx.cos(angle), mx.cos(angle)], axis=-1).astype(x.dtype), 2)
        sin = mx.expand_dims(mx.concatenate([mx.sin(angle), mx.sin(angle)], axis=-1).astype(x.dtype), 2)
        out.append(xd * cos + _rotate_half(xd) * sin)
    return mx.concatenate(out, axis=-1)


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.a = a
        d, hd, clip = a.hidden_size, a.head_dim, a.use_clipped_linears
        self.q_proj = ClippableLinear(d, a.num_attention_heads * hd, clip)
        self.k_proj = ClippableLinear(d, a.num_key_value_heads * hd, clip)
        self.v_proj = ClippableLinear(d, a.num_key_value_heads * hd, clip)
        self.o_proj = ClippableLinear(a.num_attention_heads * hd, d, clip)
        self.q_norm = nn.RMSNorm(hd)  # (its weight: the norm itself runs in float32)
        self.k_norm = nn.RMSNorm(hd)

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        a = self.a
        B, L, _ = x.shape
        q = f32_rms_norm(self.q_proj(x).reshape(B, L, a.num_attention_heads, a.head_dim), self.q_norm.weight, 1e-6)
        k = f32_rms_norm(self.k_proj(x).reshape(B, L, a.num_key_value_heads, a.head_dim), self.k_norm.weight, 1e-6)
        v = f32_rms_norm(self.v_proj(x).reshape(B, L, a.num_key_value_heads, a.head_dim), None, 1e-6)
        q, k = rope_2d(q, positions, a.rope_theta), rope_2d(k, positions, a.rope_theta)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = fused_attention(q, k, v, 1.0, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        clip = a.use_clipped_linears
        self.gate_proj = ClippableLinear(a.hidden_size, a.intermediate_size, clip)
        self.up_proj = ClippableLinear(a.hidden_size, a.intermediate_size, clip)
        self.down_proj = ClippableLinear(a.intermediate_size, a.hidden_size, clip)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        eps = a.rms_norm_eps
        self.self_attn = VisionAttention(a)
        self.mlp = VisionMLP(a)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(a.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(a.hidden_size, eps=eps)

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class PatchEmbedder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.input_proj = nn.Linear(3 * a.patch_size**2, a.hidden_size, bias=False)
        self.position_embedding_table = mx.ones((2, a.position_embedding_size, a.hidden_size))

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        h = self.input_proj((2 * (patches - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        one_hot = (mx.expand_dims(positions, -1) == mx.arange(table.shape[1])).astype(mx.float32)
        embedded = (one_hot.transpose(0, 2, 1, 3).astype(table.dtype) @ table).sum(axis=1)
        return h + mx.where(mx.zeros(positions.shape[:2] + (1,), dtype=mx.bool_), 0.0, embedded)


class Encoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layers = [VisionBlock(a) for _ in range(a.num_hidden_layers)]


class VisionTower(nn.Module):
    """`features = tower(patches, grid)` for one image: [pH * pW, 3 * p * p] -> [pH * pW / 9, hidden]."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.patch_embedder = PatchEmbedder(a)
        self.encoder = Encoder(a)
        if a.standardize:
            self.std_bias = mx.zeros((a.hidden_size,))
            self.std_scale = mx.ones((a.hidden_size,))

    def __call__(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        a = self.args
        _, gh, gw = grid
        cols, rows = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
        positions = mx.array(np.stack([cols.reshape(-1), rows.reshape(-1)], axis=-1).astype(np.int32))[None]
        x = self.patch_embedder(patches[None], positions)
        L = x.shape[1]
        mask = mx.expand_dims(mx.where(mx.ones((1, L, L), dtype=mx.bool_), mx.array(0.0, x.dtype), -1e4), 1)
        for layer in self.encoder.layers:
            x = layer(x, positions, mask)
        k = a.pooling_kernel_size
        length = L // (k * k)
        if L != length:  # each k x k block of patches averaged into one soft token
            kernel = mx.floor(positions.astype(mx.float32) / k).astype(mx.int32)
            index = kernel[..., 0] + (gw // k) * kernel[..., 1]
            weights = (mx.expand_dims(index, -1) == mx.arange(length)).astype(mx.float32) / (k * k)
            x = mx.einsum("bLl,bLd->bld", weights, x).astype(x.dtype)
        x = x[0] * a.hidden_size**0.5
        if a.standardize:
            x = (x - self.std_bias) * self.std_scale
        return x


class Embedder(nn.Module):
    """Soft tokens (vision or audio) into the text model's width: a scale-free RMSNorm, a linear."""

    def __init__(self, dims: int, text_hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(dims, text_hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))
