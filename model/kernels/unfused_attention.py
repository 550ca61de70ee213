"""Causal attention as plain matmuls and a softmax: MLX's own fallback formula, op for op.

Bit-identical to `mx.fast.scaled_dot_product_attention(..., mask="causal")` wherever MLX itself
falls back (the CPU). Used for a prefill after a prompt-cache hit on CUDA: there the fused kernel
builds a cuDNN graph per new (q, k) shape, ~66 ms on an H200, and a suffix after a hit has a new
k length almost every time (its scores matrix is small: a short suffix against the cached prefix).
"""

from __future__ import annotations

import mlx.core as mx

# The mask value that asks the decoder's attention for this formula instead of the fused kernel.
UNFUSED_CAUSAL = "unfused-causal"


def unfused_causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q: (B, Hq, L, D); k, v: (B, Hk, kL, D), kL >= L (the queries are the last L positions)."""
    B, n_heads, L, D = q.shape
    n_kv = k.shape[1]
    q = mx.array(scale, q.dtype) * q
    if n_heads != n_kv:
        q = q.reshape(B, n_kv, n_heads // n_kv, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    kL = k.shape[-2]
    offset = max(kL - L, 0)
    mask = mx.expand_dims(mx.arange(offset, offset + L), 1) >= mx.expand_dims(mx.arange(kL), 0)
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(B, n_heads, L, -1) if n_heads != n_kv else out
