"""Quantized KV caches: one row (`QuantizedKVCache`) and a left-padded batch of quantized rows
(`QuantizedBatchKVCache`); model/kv/mixed.py batches rows that turn quantized one by one.

Storage and attention are mlx-lm's (`QuantizedKVCache`, `quantized_scaled_dot_product_attention`):
keys and values are `mx.quantize`d per position in groups along the head dimension, held as
(packed, scales, biases) triples, and attention multiplies by them with `mx.quantized_matmul`.
A row's caches turn quantized after the forward that reaches its conversion point
(model/kv/scheme.py); until then it is an ordinary `KVCache`. In a batch, rows before and after
that point decode together: `MixedBatchKVCache` keeps each kind in a left-padded batch of its own
and runs attention per kind on that kind's rows, so every row computes exactly what it would alone.

These caches attend themselves (`attend`): the model hands them the step's queries, keys and
values instead of calling the fused attention kernel. On CUDA a decode step (one query per row)
attends with model/kv/quant_kernel.py's fused kernel, which reads the quantized bytes directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from model.kv import quant_kernel as kv_quant_kernel
from model.kv.cache import STEP, Attend, KVCache, MixedMerge, causal_mask
from model.kv.scheme import LayerQuant

# (packed uint32, scales, biases): one quantized tensor.
QTriple = tuple[mx.array, mx.array, mx.array]
# Full-precision attention (queries, keys, values, mask) -> out: the model's own.


def quantize(x: mx.array, quant: LayerQuant) -> QTriple:
    packed, scales, biases = mx.quantize(x, group_size=quant.group_size, bits=quant.bits)
    return packed, scales, biases


def _cuda() -> bool:
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def quantized_attention(
    queries: mx.array, keys: QTriple, values: QTriple, scale: float, mask: Any, quant: LayerQuant
) -> mx.array:
    """mlx-lm's quantized scaled dot-product attention. `mask`: None, "causal" (any string) or a
    boolean array broadcastable to [B, 1, L, K]."""
    g, b = quant.group_size, quant.bits
    if _cuda():
        # MLX's CUDA quantized_matmul has no kernel for these products (H100, mlx 0.32.4: a
        # prefill chunk's rows raised "no implementation for problem shape" or stalled, and so did
        # one decode row over a 16k cache, whose K/V are views into a larger buffer, not
        # row-contiguous; the scores @ V product is untransposed, which its fast paths exclude):
        # the fused attention over the dequantized keys and values, the same products up to
        # summation order, without materializing a chunk's [heads, L, K] scores (at a 2048-token
        # chunk over 16k positions, 2 GB per layer). The cache still holds (and admission bills)
        # the quantized bytes; a decode step takes model/kv/quant_kernel.py instead.
        k = mx.dequantize(*keys, group_size=g, bits=b)
        v = mx.dequantize(*values, group_size=g, bits=b)
        if isinstance(mask, str):
            qL, kL = queries.shape[-2], k.shape[-2]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        keys = (mx.expand_dims(keys[0], -3), mx.expand_dims(keys[1], -3), mx.expand_dims(keys[2], -3))
        values = (mx.expand_dims(values[0], -3), mx.expand_dims(values[1], -3), mx.expand_dims(values[2], -3))
    scores = mx.quantized_matmul(queries, *keys, transpose=True, group_size=g, bits=b)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *values, transpose=False, group_size=g, bits=b)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, D))
    return out


def _grow(store: QTriple | None, used: int, incoming: QTriple) -> QTriple:
    """`store`'s first `used` positions with room for `incoming`, capacity a multiple of STEP
    (as model/kv/cache.py grows full-precision buffers)."""
    n = incoming[0].shape[2]
    if store is None:
        cap = -(-n // STEP) * STEP
        return tuple(mx.zeros((*a.shape[:2], cap, a.shape[3]), a.dtype) for a in incoming)  # type: ignore[return-value]
    cap = -(-(used + n) // STEP) * STEP
    out = []
    for a in store:
        kept = a[..., :used, :] if used % STEP else a[..., : min(used, a.shape[2]), :]
        out.append(mx.concatenate([kept, mx.zeros((*a.shape[:2], cap - kept.shape[2], a.shape[3]), a.dtype)], axis=2))
    return out[0], out[1], out[2]


def _write(store: QTriple, start: int, end: int, incoming: QTriple) -> None:
    for a, x in zip(store, incoming):
        a[..., start:end, :] = x


def _slice(t: QTriple, start: int, end: int | None = None) -> QTriple:
    return t[0][..., start:end, :], t[1][..., start:end, :], t[2][..., start:end, :]


def _rows(t: QTriple, idx: mx.array) -> QTriple:
    return t[0][idx], t[1][idx], t[2][idx]


def _nbytes(t: QTriple | None) -> int:
    return 0 if t is None else sum(a.nbytes for a in t)


class QuantizedKVCache:
    """One sequence's quantized keys/values for one layer; trimmable; `offset` is an int.
    `converted_at`: the position from which this row's forwards attended quantized keys (the
    positions before it were computed over full-precision ones): two caches of the same tokens
    hold the same values only when it agrees."""

    spill_kind: str | None = "qkv"  # the SSD tier stores its packed values, scales and biases

    @classmethod
    def batched(cls, caches: Sequence[Any], quant: Any, mixed: MixedMerge | None) -> Any:
        """Rows that have turned quantized join a batch whose rows turn one by one."""
        assert mixed is not None  # (a quantized row exists only under a quantizing scheme)
        return mixed(quant, caches)

    def __init__(self, quant: LayerQuant, converted_at: int = 0) -> None:
        self.quant = quant
        self.converted_at = converted_at
        self.keys: QTriple | None = None
        self.values: QTriple | None = None
        self.offset = 0
        self.pinned_slots = 0

    @classmethod
    def from_full(cls, cache: KVCache, quant: LayerQuant) -> QuantizedKVCache:
        """mlx-lm's `KVCache.to_quantized`: every stored position quantized (the buffer's spare
        slots too, so capacities stay as they were)."""
        q = cls(quant, converted_at=cache.offset)
        q.offset = cache.offset
        if cache.keys is not None and cache.values is not None:
            q.keys, q.values = quantize(cache.keys, quant), quantize(cache.values, quant)
        return q

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QTriple, QTriple]:
        prev, n = self.offset, keys.shape[2]
        qk, qv = quantize(keys, self.quant), quantize(values, self.quant)
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            self.keys, self.values = _grow(self.keys, prev, qk), _grow(self.values, prev, qv)
            self.pinned_slots = 0
        self.offset += n
        _write(self.keys, prev, self.offset, qk)
        _write(self.values, prev, self.offset, qv)
        if self.offset < self.keys[0].shape[2]:
            return _slice(self.keys, 0, self.offset), _slice(self.values, 0, self.offset)
        return self.keys, self.values

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, _: Attend
    ) -> mx.array:
        qk, qv = self.update_and_fetch(keys, values)
        if mask is None and kv_quant_kernel.usable(queries, qk, self.quant.bits, self.quant.group_size):
            return kv_quant_kernel.decode_attention(queries, qk, qv, scale, None, self.quant.bits)
        return quantized_attention(queries, qk, qv, scale, mask, self.quant)

    def make_mask(self, N: int) -> str | None:
        return None if N == 1 else "causal"

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [*self.keys, *self.values]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def clone(self) -> QuantizedKVCache:
        other = QuantizedKVCache(self.quant, self.converted_at)
        if self.keys is not None and self.values is not None:
            other.keys, other.values = _slice(self.keys, 0, self.offset), _slice(self.values, 0, self.offset)
            other.pinned_slots = max(self.keys[0].shape[2], self.pinned_slots)
        other.offset = self.offset
        return other

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        slots = self.keys[0].shape[2]
        return (_nbytes(self.keys) + _nbytes(self.values)) // slots * max(slots, self.pinned_slots)


class QuantizedBatchKVCache:
    """Left-padded quantized rows for one layer: `BatchKVCache`'s layout and rules over triples."""

    spill_kind: str | None = None

    def __init__(self, quant: LayerQuant, left_padding: Sequence[int], converted_at: Sequence[int]) -> None:
        self.quant = quant
        self.keys: QTriple | None = None
        self.values: QTriple | None = None
        self.pads: list[int] = [int(p) for p in left_padding]
        self.converted_at: list[int] = list(converted_at)
        self.left_padding = mx.array(self.pads)
        self.offset = mx.array([-p for p in self.pads])
        self._idx = 0

    @classmethod
    def merge(cls, quant: LayerQuant, caches: Sequence[QuantizedKVCache]) -> QuantizedBatchKVCache:
        lengths = [c.offset for c in caches]
        max_length = max(lengths)
        padding = [max_length - n for n in lengths]
        batch = cls(quant, padding, [c.converted_at for c in caches])
        ref = next((c for c in caches if c.keys is not None), None)
        if max_length == 0 or ref is None or ref.keys is None or ref.values is None:
            return batch
        ref_k, ref_v = ref.keys, ref.values

        def blank(t: QTriple) -> list[mx.array]:
            return [mx.zeros((len(caches), a.shape[1], max_length, a.shape[3]), a.dtype) for a in t]

        keys, values = blank(ref_k), blank(ref_v)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None or c.values is None:
                continue
            for store, src in ((keys, c.keys), (values, c.values)):
                for a, s in zip(store, src):
                    a[i : i + 1, :, p : p + c.offset] = s[..., : c.offset, :]
        batch.keys, batch.values = (keys[0], keys[1], keys[2]), (values[0], values[1], values[2])
        batch.offset = batch.offset + max_length
        batch._idx = max_length
        return batch

    @property
    def size(self) -> int:
        return len(self.pads)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QTriple, QTriple]:
        prev, n = self._idx, keys.shape[2]
        qk, qv = quantize(keys, self.quant), quantize(values, self.quant)
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            self.keys, self.values = _grow(self.keys, prev, qk), _grow(self.values, prev, qv)
        self.offset = self.offset + n
        self._idx += n
        _write(self.keys, prev, self._idx, qk)
        _write(self.values, prev, self._idx, qv)
        return _slice(self.keys, 0, self._idx), _slice(self.values, 0, self._idx)

    def make_mask(self, N: int) -> mx.array:
        return causal_mask(N, self._idx, left_padding=self.left_padding)

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, _: Attend
    ) -> mx.array:
        own_mask = self.make_mask(keys.shape[2])  # (the model's mask may be another layout's)
        qk, qv = self.update_and_fetch(keys, values)
        if kv_quant_kernel.usable(queries, qk, self.quant.bits, self.quant.group_size):  # CUDA decode
            return kv_quant_kernel.decode_attention(queries, qk, qv, scale, self.left_padding, self.quant.bits)
        return quantized_attention(queries, qk, qv, scale, own_mask, self.quant)

    @property
    def state(self) -> list[mx.array]:
        arrays = [self.offset, self.left_padding]
        return arrays if self.keys is None or self.values is None else arrays + [*self.keys, *self.values]

    def filter(self, keep: Sequence[int]) -> None:
        idx = mx.array(list(keep))
        if self.keys is not None and self.values is not None:
            self.keys, self.values = _rows(self.keys, idx), _rows(self.values, idx)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        self.pads = [self.pads[i] for i in keep]
        self.converted_at = [self.converted_at[i] for i in keep]
        min_pad = min(self.pads) if self.pads else 0
        if min_pad > 0:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = _slice(self.keys, min_pad), _slice(self.values, min_pad)
            self._idx -= min_pad
            self.left_padding = self.left_padding - min_pad
            self.pads = [p - min_pad for p in self.pads]

    def extend(self, other: QuantizedBatchKVCache) -> None:
        """Append `other`'s rows, right-justifying both so every row ends at the same slot."""
        self.converted_at = self.converted_at + other.converted_at
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self.pads = self.pads + other.pads
            return
        max_idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        assert ref.keys is not None and ref.values is not None
        ref_k, ref_v = ref.keys, ref.values
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: QuantizedBatchKVCache) -> tuple[list[mx.array], mx.array, mx.array]:
            rows = len(c.pads)
            k = (
                list(c.keys)
                if c.keys is not None
                else [mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in ref_k]
            )
            v = (
                list(c.values)
                if c.values is not None
                else [mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in ref_v]
            )
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            arrays = k + v
            if right < 0:
                arrays, right = [a[..., :right, :] for a in arrays], 0
            if left or right:
                arrays = [mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]) for a in arrays]
            return arrays, c.offset, c.left_padding + left

        self.pads = [p + max_idx - self._idx for p in self.pads] + [p + max_idx - other._idx for p in other.pads]
        (mine, my_off, my_lp), (theirs, their_off, their_lp) = pad(self), pad(other)
        joined = [mx.concatenate([a, b]) for a, b in zip(mine, theirs)]
        self.keys, self.values = (joined[0], joined[1], joined[2]), (joined[3], joined[4], joined[5])
        self.offset = mx.concatenate([my_off, their_off])
        self.left_padding = mx.concatenate([my_lp, their_lp])
        self._idx = max_idx

    def extract(self, i: int) -> QuantizedKVCache:
        """Row i as a solo cache with its padding stripped (a copy)."""
        pad = self.pads[i]
        cache = QuantizedKVCache(self.quant, self.converted_at[i])
        if self.keys is not None and self.values is not None:
            k, v = (
                _slice(_rows(self.keys, mx.array([i])), pad, self._idx),
                _slice(_rows(self.values, mx.array([i])), pad, self._idx),
            )
            cache.keys = (mx.contiguous(k[0]), mx.contiguous(k[1]), mx.contiguous(k[2]))
            cache.values = (mx.contiguous(v[0]), mx.contiguous(v[1]), mx.contiguous(v[2]))
            cache.offset = self._idx - pad
        return cache

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


# The quantized caches that run their own attention (`attend`); model/kv/mixed.py adds its own.
QUANTIZED_CACHES = (QuantizedKVCache, QuantizedBatchKVCache)
