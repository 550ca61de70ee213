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
Where the triangle is a small part of the scores — a short suffix after a long cached prefix,
a chat's next turn — blocks save nothing; there the same ops run as one block with the softmax's
rows split over two MLX CPU streams, each on a thread of its own (every row is computed alone,
so again the same bits): a 157-token suffix after 1453 cached tokens prefilled in 51-60 ms
against 70-74 ms on 2 cores.

On first use it also compares itself with MLX on small inputs and turns itself off on any
difference (a newer MLX with its own CPU kernel, say): then a prefill is only slower, never
different.
"""

from __future__ import annotations

import logging
import os
import threading

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Queries per block: 64 measured best (7 x 290 tokens: 28 vs 38 ms; 2048 tokens: 196 vs 300 ms).
BLOCK = 64
_LOWEST = float(np.finfo(np.float32).min)
# Streams a one-block softmax is split over (one per core, at most this many). Splitting the
# blocked path's softmax did not help (322 vs 314 ms for 7 x 290 tokens: OpenBLAS has the cores).
SPLIT_STREAMS = 2
# Fewer queries than this: MLX's own kernel (a split is not worth its extra ops).
MIN_SPLIT_QUERIES = 16
_per_thread = threading.local()
# Whether the self-check against MLX has run, and what it found (checked on first use).
_state: dict[str, bool] = {"enabled": True, "checked": False}


def _blocks_pay(L: int, kL: int) -> bool:
    """Blocks skip the masked triangle: worth it when at most L - 2 * BLOCK keys come before the
    L queries. A short suffix after a long cached prefix sees nearly every key from every block
    (157 queries after 1453 keys: 71 ms blocked against 67 ms in one)."""
    return kL - L <= L - 2 * BLOCK


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, block: int | None = None) -> mx.array:
    """`scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")` as MLX's CPU fallback
    computes it: in query blocks where the masked triangle is large, else in one block with the
    softmax split over CPU streams. q: (B, Hq, L, D); k, v: (B, Hk, kL, D), kL >= L (the queries
    are the last L positions). `block` forces a block size (tests)."""
    B, n_q_heads, L, _ = q.shape
    n_kv_heads, kL = k.shape[1], k.shape[2]
    if block is None:
        block = BLOCK if _blocks_pay(L, kL) else L
    split = block >= L
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
        masked = mx.where(mask, scores, lowest)
        probs = _split_softmax(masked) if split else mx.softmax(masked, axis=-1, precise=True)
        if seen < kL:
            probs = mx.concatenate([probs, mx.zeros((*probs.shape[:-1], kL - seen), probs.dtype)], axis=-1)
        outs.append(probs @ v)
    out = mx.concatenate(outs, axis=-2)
    return out.reshape(B, n_q_heads, L, -1) if repeats > 1 else out


def _split_softmax(scores: mx.array) -> mx.array:
    """The precise softmax of each row, the rows split over CPU streams (a thread each)."""
    streams = _streams()
    rows = scores.shape[-2]
    if len(streams) < 2 or rows < MIN_SPLIT_QUERIES:
        return mx.softmax(scores, axis=-1, precise=True)
    bounds = [rows * i // len(streams) for i in range(len(streams) + 1)]
    parts = []
    for stream, lo, hi in zip(streams, bounds, bounds[1:]):
        with mx.stream(stream):
            parts.append(mx.softmax(scores[..., lo:hi, :], axis=-1, precise=True))
    return mx.concatenate(parts, axis=-2)


def _streams() -> list[mx.Stream]:
    """The default CPU stream and one more per further core, up to SPLIT_STREAMS; made on first
    use in each thread, because MLX's streams belong to the thread that made them (a test suite
    runs one MLX thread per server, one after another)."""
    streams = getattr(_per_thread, "streams", None)
    if streams is None:
        count = max(1, min(SPLIT_STREAMS, os.cpu_count() or 1))
        streams = _per_thread.streams = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(count - 1)]
    return streams


def applies(q: mx.array, k: mx.array, mask: object) -> bool:
    """Worth it and exact: CPU, float32, a causal prefill whose masked triangle is large (blocks)
    or, on more than one core, any prefill of MIN_SPLIT_QUERIES queries or more (a split softmax)."""
    if not (_state["enabled"] and isinstance(mask, str) and mask == "causal"):
        return False
    if q.dtype != mx.float32 or mx.default_device().type != mx.cpu:
        return False  # checked before `_streams()`, which would make CPU streams on a GPU box
    L = q.shape[2]
    if not (_blocks_pay(L, k.shape[2]) or (L >= MIN_SPLIT_QUERIES and len(_streams()) > 1)):
        return False
    if not _state["checked"]:
        _state["checked"] = True
        _state["enabled"] = _agrees_with_mlx()
        if not _state["enabled"]:
            log.warning("blocked causal attention differs from MLX's on this build: using MLX's own")
    return _state["enabled"]


def _agrees_with_mlx() -> bool:
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((2, 2, 170, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 2, 170, 64)).astype(np.float32))
    for queries, block in ((150, 32), (40, None)):  # blocked; one block, split softmax
        q = mx.array(rng.standard_normal((2, 4, queries, 64)).astype(np.float32))
        ours = causal_attention(q, k, v, 0.125, block=block)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        if not np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)):
            return False
    return True
