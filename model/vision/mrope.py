"""Multimodal RoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): each token has a (t, h, w) position; the
rotary frequencies are split into three sections, each turned by one of the three: consecutive
("chunked", Qwen2.5-VL) or interleaved t, h, w, t, h, w, ... (Qwen3-VL, Qwen3.5).

Text tokens have t = h = w, so a text-only run equals plain RoPE at that position. An image's
tokens share one t and spread over its merged grid in h and w; the text after an image resumes
from the image's largest position + 1, so a prompt's last position is not its length - 1: the
difference (`delta`) shifts every later token of the row. Matches mlx-vlm's `get_rope_index` and
its cos/sin application (both layouts) bit for bit. A video is its frames' runs, each an image of
(1, h, w) (Qwen3-VL's rule; the caller splits its grid).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import mlx.core as mx
import numpy as np


def rope_index(
    tokens: Sequence[int], pad_ids: Collection[int], grids: Sequence[tuple[int, int, int]], merge: int
) -> tuple[np.ndarray, int]:
    """[3, L] positions of a prompt whose pad runs (tokens of `pad_ids`, in order) have these
    (t, h, w) grids, and the row's delta: (largest position + 1) - L."""
    parts: list[np.ndarray] = []
    start = 0
    next_pos = 0
    pads = np.flatnonzero(np.isin(np.asarray(tokens), list(pad_ids)))
    for t, h, w in grids:
        at = int(pads[np.searchsorted(pads, start)])
        text = at - start
        parts.append(np.broadcast_to(np.arange(text) + next_pos, (3, text)))
        gh, gw = h // merge, w // merge
        grid = np.stack(
            [
                np.repeat(np.arange(t), gh * gw),
                np.tile(np.repeat(np.arange(gh), gw), t),
                np.tile(np.arange(gw), t * gh),
            ]
        )
        parts.append(grid + text + next_pos)
        next_pos = int(parts[-1].max()) + 1
        start = at + t * gh * gw
    tail = len(tokens) - start
    parts.append(np.broadcast_to(np.arange(tail) + next_pos, (3, tail)))
    positions = np.concatenate(parts, axis=1)
    return positions, int(positions.max()) + 1 - len(tokens) if positions.size else 0


def section_selector(sections: Sequence[int], freq_dim: int, *, interleaved: bool = False) -> mx.array:
    """Which of (t, h, w) drives each rotary frequency."""
    selector = np.zeros(freq_dim, dtype=np.int32)
    if interleaved:  # h on frequencies 1, 4, 7, ..., w on 2, 5, 8, ..., each for its section's length
        for axis in (1, 2):
            selector[axis : min(3 * sections[axis], freq_dim) : 3] = axis
        return mx.array(selector)
    offset = sections[0]
    for axis, length in enumerate(sections[1:], start=1):
        selector[offset : offset + length] = axis
        offset += length
    return mx.array(selector)


def cos_sin(positions: mx.array, inv_freq: mx.array, selector: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """[3, B, L] positions -> cos, sin of shape [B, 1, L, head_dim] (broadcast over heads)."""
    freqs = mx.take(positions, selector, axis=0).transpose(1, 2, 0).astype(mx.float32) * inv_freq
    emb = mx.concatenate([freqs, freqs], axis=-1)
    return mx.expand_dims(mx.cos(emb).astype(dtype), 1), mx.expand_dims(mx.sin(emb).astype(dtype), 1)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return ((x * cos) + (rotated * sin)).astype(x.dtype)


@mx.compile
def rotate_prefix(q: mx.array, k: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
    """[B, H, L, D] queries and keys turned on their first cos.shape[-1] dims by [B, L, dims]
    cos, sin (Qwen3.5's partial rotary; mlx-vlm's compiled application, the same ops)."""
    cos, sin = mx.expand_dims(cos, axis=1), mx.expand_dims(sin, axis=1)
    dims = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :dims], q[..., dims:], k[..., :dims], k[..., dims:]
    q_rot = ((q_rot * cos) + (_rotate_half(q_rot) * sin)).astype(q.dtype)
    k_rot = ((k_rot * cos) + (_rotate_half(k_rot) * sin)).astype(k.dtype)
    return mx.concatenate([q_rot, q_pass], axis=-1), mx.concatenate([k_rot, k_pass], axis=-1)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
