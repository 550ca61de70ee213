"""Qwen3-VL's vision tower, as Qwen3.5 uses it: a ViT over 16x16x2 patches with learned position
embeddings (bilinearly resampled to each image's grid) and 2-D rotary positions, full attention
within each image or video frame, and a merger that folds each 2x2 group of patches into one text
token. Qwen3-VL's DeepStack mergers (features of middle blocks added to early text layers) are
not built: Qwen3.5 checkpoints have none (`deepstack_visual_indexes` is empty; mlx-vlm refuses one
that is not).

Op for op as mlx-vlm's qwen3_vl vision module (features equal its on the same weights); parameter
names follow the checkpoint's `visual.*`.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

_FUSED_HEAD_DIMS = (64, 80, 128)  # what MLX's fused attention takes: smaller heads are zero-padded


@attrs.frozen
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304

    @classmethod
    def from_config(cls, vision: dict[str, Any], text_hidden: int) -> VisionArgs:
        if vision.get("deepstack_visual_indexes"):
            raise ValueError("deepstack_visual_indexes: DeepStack vision features are not supported")
        return cls(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            out_hidden_size=int(vision.get("out_hidden_size") or text_hidden),
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
        )


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def fused_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
    """Attention with the head dim zero-padded to the next size MLX's fused kernel takes (as
    mlx-vlm's `ensure_fused_sdpa`: the zeros change no score, and the kernel runs the same shapes)."""
    d = q.shape[-1]
    target = next((t for t in _FUSED_HEAD_DIMS if d <= t), d)
    if target != d:
        pad = [(0, 0)] * (q.ndim - 1) + [(0, target - d)]
        q, k, v = mx.pad(q, pad), mx.pad(k, pad), mx.pad(v, pad)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)[..., :d]


class PatchEmbed(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.a = a
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = nn.Conv3d(a.in_channels, a.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        a = self.a
        x = x.reshape(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size).moveaxis(1, 4)
        return self.proj(x).reshape(-1, a.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, bounds: list[int], cos: mx.array, sin: mx.array) -> mx.array:
        S = x.shape[0]
        q, k, v = mx.split(self.qkv(x).reshape(S, 3, self.num_heads, -1).transpose(1, 0, 2, 3), 3)
        q = ((q * cos) + (_rotate_half(q) * sin)).astype(x.dtype)
        k = ((k * cos) + (_rotate_half(k) * sin)).astype(x.dtype)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        splits = [mx.split(t, bounds, axis=2) for t in (q, k, v)]  # each frame attends within itself
        out = [fused_attention(qi, ki, vi, self.scale) for qi, ki, vi in zip(*splits)]
        return self.proj(mx.concatenate(out, axis=2).transpose(0, 2, 1, 3).reshape(S, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(nn.gelu_approx(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.attn = VisionAttention(a.hidden_size, a.num_heads)
        self.mlp = VisionMLP(a.hidden_size, a.intermediate_size)

    def __call__(self, x: mx.array, bounds: list[int], cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.norm = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, a.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """`features = tower(pixel_values, grid_thw)`: [patches, C*T*P*P] -> [patches / merge^2, out_hidden].
    A video's grid (t, h, w) gives t frames' features in order, each as an image of (1, h, w)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.pos_embed = nn.Embedding(a.num_position_embeddings, a.hidden_size)
        self.side = int(a.num_position_embeddings**0.5)
        self.blocks = [VisionBlock(a) for _ in range(a.depth)]
        self.merger = PatchMerger(a)
        rot_dim = a.hidden_size // a.num_heads // 2
        self._inv_freq = 1.0 / (10000.0 ** (mx.arange(0, rot_dim, 2, dtype=mx.float32) / rot_dim))

    def __call__(self, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
        x = self.patch_embed(pixel_values.astype(self.patch_embed.proj.weight.dtype))
        x = x + self._position_embeddings(grid_thw)
        freqs = self._rotary(grid_thw)
        cos = mx.expand_dims(mx.tile(mx.expand_dims(mx.cos(freqs), 1), (1, 1, 2)), 0)
        sin = mx.expand_dims(mx.tile(mx.expand_dims(mx.sin(freqs), 1), (1, 1, 2)), 0)
        bounds = np.cumsum([h * w for t, h, w in grid_thw for _ in range(t)])[:-1].tolist()
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x)

    def _position_embeddings(self, grid_thw: list[tuple[int, int, int]]) -> mx.array:
        """The learned [side, side] table resampled bilinearly to each grid (corners aligned), in
        merge-group order, repeated over a video's frames."""
        n, m = self.side, self.args.spatial_merge_size
        index: list[list[mx.array]] = [[], [], [], []]
        weight: list[list[mx.array]] = [[], [], [], []]
        for _, h, w in grid_thw:
            hi, wi = mx.linspace(0, n - 1, h), mx.linspace(0, n - 1, w)
            h0, w0 = hi.astype(mx.int32), wi.astype(mx.int32)
            h1, w1 = mx.minimum(h0 + 1, n - 1), mx.minimum(w0 + 1, n - 1)
            dh, dw = hi - h0.astype(mx.float32), wi - w0.astype(mx.float32)
            rows = [h0 * n, h0 * n, h1 * n, h1 * n]
            cols = [w0, w1, w0, w1]
            ys = [1 - dh, 1 - dh, dh, dh]
            xs = [1 - dw, dw, 1 - dw, dw]
            for i in range(4):
                index[i].append((rows[i][:, None] + cols[i][None, :]).flatten())
                weight[i].append((ys[i][:, None] * xs[i][None, :]).flatten())
        embeds = self.pos_embed(mx.stack([mx.concatenate(i) for i in index]))
        weights = mx.stack([mx.concatenate(w) for w in weight]).astype(embeds.dtype)
        embeds = embeds * weights[:, :, None]
        table = embeds[0] + embeds[1] + embeds[2] + embeds[3]
        out, start = [], 0
        for t, h, w in grid_thw:
            part = mx.tile(table[start : start + h * w], (t, 1))
            start += h * w
            d = part.shape[-1]
            out.append(part.reshape(t, h // m, m, w // m, m, d).transpose(0, 1, 3, 2, 4, 5).reshape(-1, d))
        return mx.concatenate(out)

    def _rotary(self, grid_thw: list[tuple[int, int, int]]) -> mx.array:
        """Each patch's (row, column) frequencies, in merge-group order (integer work in numpy)."""
        m = self.args.spatial_merge_size
        ids = []
        for t, h, w in grid_thw:
            bh, bw, ih, iw = np.indices((h // m, w // m, m, m))
            rows, cols = (bh * m + ih).reshape(-1), (bw * m + iw).reshape(-1)
            ids.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
        pos = mx.array(np.concatenate(ids, axis=0))
        longest = max(max(h, w) for _, h, w in grid_thw)
        table = mx.outer(mx.arange(longest, dtype=mx.float32), self._inv_freq)
        return mx.concatenate([table[pos[:, 0]], table[pos[:, 1]]], axis=-1)

    def sanitize(self, weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
        """PyTorch's Conv3d weight [out, C, T, P, P] as MLX's [out, T, P, P, C]."""
        key = f"{prefix}patch_embed.proj.weight"
        w = weights.get(key)
        if w is not None and w.ndim == 5 and w.shape[1] == self.args.in_channels and w.shape[-1] != w.shape[1]:
            weights[key] = w.transpose(0, 2, 3, 4, 1)
        return {k: v for k, v in weights.items() if "position_ids" not in k}
