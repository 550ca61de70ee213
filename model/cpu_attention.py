"""Causal prefill attention on MLX's CPU backend: bit for bit MLX's own, with about half the work.

On the CPU, `mx.fast.scaled_dot_product_attention` is MLX's fallback (mlx/fast.cpp): scale q,
`scores = q @ k^T`, masked entries set to float32's lowest value, a precise softmax, then
`scores @ v`. For a causal prompt half the scores are masked, yet each costs an `exp` (~12 ns a
float on x86, most of a CPU prefill's attention time).

`causal_attention` runs the same ops in blocks of queries, each against only the keys it can
see. That gives the same bits, for these reasons, all checked against MLX by
tests/test_cpu_attention.py:
  * `q @ k^T` sums over head_dim whatever the block: each score is the same dot product.
  * MLX's CPU softmax (mlx/backend/cpu/softmax.cpp; one lane on x86) takes the row's max and
    sums its `exp`s left to right. The dropped masked entries are never the max and add exact
    zeros at the row's end.
  * `p @ v` keeps the full key length, the block's probabilities padded with zeros: OpenBLAS
    splits a product's inner dimension into blocks by its length, so a shorter one would round
    its sums differently (measured: it does, at 612 and 2048 keys).
On first use it also compares itself with MLX on a small input and turns itself off on any
difference (a newer MLX with its own CPU kernel, say): then a prefill is only slower, never
different. MLX_TRIO_CPU_EXACT_ATTENTION=0 turns it off.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Queries per block: 64 measured best (7 x 290 tokens: 28 vs 38 ms; 2048 tokens: 196 vs 300 ms).
BLOCK = 64
_LOWEST = float(np.finfo(np.float32).min)
_state = {"enabled": os.environ.get("MLX_TRIO_CPU_EXACT_ATTENTION", "1") != "0", "checked": False}


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, block: int = BLOCK) -> mx.array:
    """`scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")` as MLX's CPU fallback
    computes it, query block by query block. q: (B, Hq, L, D); k, v: (B, Hk, kL, D), kL >= L
    (the queries are the last L positions)."""
    B, n_q_heads, L, _ = q.shape
    n_kv_heads, kL = k.shape[1], k.shape[2]
    repeats = n_q_heads // n_kv_heads
    q = mx.array(scale, q.dtype) * q
    if repeats > 1:
        q = q.reshape(B, n_kv_heads, repeats, L, -1)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    lowest = mx.array(_LOWEST, mx.float32)
    first = kL - L  # the position of query 0
    outs = []
    for start in range(0, L, block):
        stop = min(L, start + block)
        seen = first + stop  # keys this block's queries may attend to
        scores = q[..., start:stop, :] @ mx.swapaxes(k[..., :seen, :], -1, -2)
        mask = mx.expand_dims(mx.arange(first + start, first + stop), 1) >= mx.arange(seen)
        probs = mx.softmax(mx.where(mask, scores, lowest), axis=-1, precise=True)
        if seen < kL:
            probs = mx.concatenate([probs, mx.zeros((*probs.shape[:-1], kL - seen), probs.dtype)], axis=-1)
        outs.append(probs @ v)
    out = mx.concatenate(outs, axis=-2)
    return out.reshape(B, n_q_heads, L, -1) if repeats > 1 else out


def applies(q: mx.array, k: mx.array, mask: object) -> bool:
    """Worth it and exact: CPU, float32, causal, and the masked triangle a large enough part
    of the scores — at most L - 2 * BLOCK keys before the L queries. A short suffix after a long
    cached prefix sees nearly every key from every block, and there blocking measured ~6% slower
    (157 queries after 1453 keys: 71 vs 67 ms)."""
    L = q.shape[2]
    if not (_state["enabled"] and isinstance(mask, str) and mask == "causal" and k.shape[2] - L <= L - 2 * BLOCK):
        return False
    if q.dtype != mx.float32 or mx.default_device().type != mx.cpu:
        return False
    if not _state["checked"]:
        _state["checked"] = True
        _state["enabled"] = _agrees_with_mlx()
        if not _state["enabled"]:
            log.warning("blocked causal attention differs from MLX's on this build: using MLX's own")
    return _state["enabled"]


def _agrees_with_mlx() -> bool:
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((2, 4, 150, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 2, 170, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 2, 170, 64)).astype(np.float32))
    ours = causal_attention(q, k, v, 0.125, block=32)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    return bool(np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)))
