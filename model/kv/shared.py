"""A layer's KV attended by later layers too (Gemma 4's KV-shared layers hold no cache of their
own: each attends over what an earlier layer of its kind stored, with that layer's mask).

`store` puts a step's keys and values in a layer's cache, whatever its kind, and returns the
attention over everything the cache then holds, as a function of the queries: the storing layer
calls it with its own queries, each sharing layer with its own. Each kind attends as its own
layer would (model/nn/decoder.py `Attention.attend_cached`, model/kv/mixed.py, model/kv/quant.py,
model/kv/paged.py).
`SharingAttention` is Gemma 4's attention (op for op as mlx-lm's gemma4_text), of either role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model.kv.cache import LayerCache
from model.kv.mixed import MixedBatchKVCache
from model.kv.paged import PagedBatchKVCache
from model.kv.quant import QUANTIZED_CACHES, QuantizedBatchKVCache, quantized_attention

# queries [B, heads, L, head_dim] -> attended, same shape.
Shared = Callable[[mx.array], mx.array]


def store(cache: Any, keys: mx.array, values: mx.array, scale: float, mask: Any) -> Shared:
    """(`cache`: any attention kind of this package; each is stored and attended its own way.)"""
    if isinstance(cache, MixedBatchKVCache):
        # Each part over its own rows with its own mask, put back in batch order (as its `attend`).
        (kf, kq), (vf, vq) = cache._split(keys), cache._split(values)
        full = cache.full
        on_full = None if full is None else store(full, kf, vf, scale, full.make_mask(keys.shape[2]))
        on_quant = None if cache.quantized is None else store(cache.quantized, kq, vq, scale, None)

        def mixed(queries: mx.array) -> mx.array:
            qf, qq = cache._split(queries)
            out_full = None if on_full is None else on_full(qf)
            return cache._unsplit(out_full, None if on_quant is None else on_quant(qq))

        return mixed
    if isinstance(cache, PagedBatchKVCache):
        return cache.store(keys, values, scale)  # (its own mask: the gathered rows' layout)
    if isinstance(cache, QuantizedBatchKVCache):
        mask = cache.make_mask(keys.shape[2])  # its own layout (the model's may be another's)
    if isinstance(cache, QUANTIZED_CACHES):
        qk, qv = cache.update_and_fetch(keys, values)
        quant = cache.quant
        return lambda queries: quantized_attention(queries, qk, qv, scale, mask, quant)
    keys, values = cache.update_and_fetch(keys, values)
    return lambda queries: mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


# What a layer hands the layers that share its KV: attention over its stored KV, and its position.
KVShare = tuple[Shared, Any]


class SharingAttention(nn.Module):
    """q/k norms, RMS-normalized values, scores unscaled; keys are also the values with `k_eq_v`.
    Without `has_kv` a layer has no key/value projections: it is called with another's `KVShare`."""

    def __init__(
        self, dim: int, heads: int, kv_heads: int, head_dim: int, has_kv: bool, k_eq_v: bool, eps: float, rope: Any
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.k_eq_v, self.eps = heads, kv_heads, k_eq_v, eps
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        if has_kv:
            self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            if not k_eq_v:
                self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.k_norm = nn.RMSNorm(head_dim, eps=eps)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.rope = rope

    def __call__(
        self, x: mx.array, mask: Any, cache: LayerCache | None, shared: KVShare | None
    ) -> tuple[mx.array, KVShare]:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        if shared is None:  # a layer of its own KV: this step's keys and values into its cache
            assert cache is not None  # (a layer that shares another's KV is given no cache)
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
            values = keys if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
            offset = cache.offset
            keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
            values = mx.fast.rms_norm(values, None, self.eps).transpose(0, 2, 1, 3)
            shared = (store(cache, keys, values, 1.0, mask), offset)
        attend, offset = shared
        out = attend(self.rope(queries.transpose(0, 2, 1, 3), offset=offset))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), shared
