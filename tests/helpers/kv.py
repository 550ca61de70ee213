"""KV caches made to measure for the cache tests."""

from __future__ import annotations

import mlx.core as mx

from model.kv.cache import KVCache

LAYERS = 2


HEAD_DIM = 4


BYTES_PER_TOKEN = LAYERS * 2 * HEAD_DIM * 4  # keys + values, float32, one head


def kv(tokens, layers=LAYERS, cls=KVCache):
    caches = []
    for _ in range(layers):
        c = cls()
        if tokens:
            col = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
            block = mx.broadcast_to(col, (1, 1, len(tokens), HEAD_DIM)) + 0  # its own exact buffer
            mx.eval(block)
            c.keys, c.values, c.offset = block, block, len(tokens)
        caches.append(c)
    return caches
