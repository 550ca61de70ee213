"""Qwen2.5-VL's vision tower: a ViT over 14x14x2 patches with 2-D rotary positions, windowed
attention in most blocks, and a merger that folds each 2x2 group of patches into one text token.

Op for op as mlx-vlm's qwen2_5_vl vision module (features equal its on the same weights);
parameter names follow the checkpoint's `visual.*`. Index bookkeeping (rotary positions, windows)
is integer work done in numpy.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np


@attrs.frozen
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, vision: dict[str, Any], text_hidden: int) -> VisionArgs:
        return cls(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            out_hidden_size=int(vision.get("out_hidden_size") or text_hidden),
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_chans", vision.get("in_channels", 3))),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes") or ()),
        )


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class PatchEmbed(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.a = a
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = nn.Conv3d(a.in_channels, a.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

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
        # Each window (or each whole image) attends only within itself.
        splits = [mx.split(t, bounds, axis=2) for t in (q, k, v)]
        out = [
            mx.fast.scaled_dot_product_attention(qi, ki, vi, scale=self.scale, mask=None) for qi, ki, vi in zip(*splits)
        ]
        return self.proj(mx.concatenate(out, axis=2).transpose(0, 2, 1, 3).reshape(S, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.norm1 = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.norm2 = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.attn = VisionAttention(a.hidden_size, a.num_heads)
        self.mlp = VisionMLP(a.hidden_size, a.intermediate_size)

    def __call__(self, x: mx.array, bounds: list[int], cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.ln_q = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, a.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionTower(nn.Module):
    """`features = tower(pixel_values, grid_thw)`: [patches, C*T*P*P] -> [patches / merge^2, out_hidden]."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.blocks = [VisionBlock(a) for _ in range(a.depth)]
        self.merger = PatchMerger(a)
        rot_dim = a.hidden_size // a.num_heads // 2
        self._inv_freq = 1.0 / (10000.0 ** (mx.arange(0, rot_dim, 2, dtype=mx.float32) / rot_dim))

    def __call__(self, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
        a = self.args
        unit = a.spatial_merge_size**2
        x = self.patch_embed(pixel_values.astype(self.patch_embed.proj.weight.dtype))
        window_index, window_bounds = self._windows(grid_thw)
        order = mx.array(window_index)
        seq = x.shape[0]
        x = x.reshape(seq // unit, unit, -1)[order].reshape(seq, -1)
        freqs = self._rotary(grid_thw)
        freqs = freqs.reshape(seq // unit, unit, -1)[order].reshape(seq, -1)
        cos = mx.expand_dims(mx.tile(mx.expand_dims(mx.cos(freqs), 1), (1, 1, 2)), 0)
        sin = mx.expand_dims(mx.tile(mx.expand_dims(mx.sin(freqs), 1), (1, 1, 2)), 0)
        full_bounds = np.cumsum([h * w for t, h, w in grid_thw for _ in range(t)])[:-1].tolist()
        for i, block in enumerate(self.blocks):
            x = block(x, full_bounds if i in a.fullatt_block_indexes else window_bounds, cos, sin)
        x = self.merger(x)
        return x[mx.array(np.argsort(window_index, kind="stable"))]

    def _rotary(self, grid_thw: list[tuple[int, int, int]]) -> mx.array:
        m = self.args.spatial_merge_size
        ids = []
        for t, h, w in grid_thw:
            hpos = np.repeat(np.arange(h)[:, None], w, axis=1)
            wpos = np.repeat(np.arange(w)[None, :], h, axis=0)
            hpos, wpos = (p.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).flatten() for p in (hpos, wpos))
            ids.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
        pos = np.concatenate(ids, axis=0)
        longest = max(max(h, w) for _, h, w in grid_thw)
        table = mx.outer(mx.arange(longest, dtype=mx.float32), self._inv_freq)
        return table[mx.array(pos)].reshape(pos.shape[0], -1)

    def _windows(self, grid_thw: list[tuple[int, int, int]]) -> tuple[np.ndarray, list[int]]:
        """The merged-patch order that groups each window's patches, and the window boundaries."""
        a = self.args
        m = a.spatial_merge_size
        side = a.window_size // m // a.patch_size
        order: list[np.ndarray] = []
        bounds = [0]
        base = 0
        for t, h, w in grid_thw:
            gh, gw = h // m, w // m
            index = np.arange(t * gh * gw).reshape(t, gh, gw)
            ph, pw = side - gh % side, side - gw % side
            padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-100)
            nh, nw = (gh + ph) // side, (gw + pw) // side
            padded = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
            sizes = (padded != -100).sum(axis=(2, 3)).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat != -100] + base)
            bounds.extend((np.cumsum(sizes) * m * m + bounds[-1]).tolist())
            base += t * gh * gw
        unique = list(dict.fromkeys(bounds))  # empty windows repeat a boundary
        return np.concatenate(order), unique[1:-1]

    def sanitize(self, weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
        """PyTorch's Conv3d weight [out, C, T, P, P] as MLX's [out, T, P, P, C]."""
        key = f"{prefix}patch_embed.proj.weight"
        w = weights.get(key)
        if w is not None and w.ndim == 5 and w.shape[1] == self.args.in_channels and w.shape[-1] != w.shape[1]:
            weights[key] = w.transpose(0, 2, 3, 4, 1)
        return weights
