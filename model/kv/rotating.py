"""Sliding-window KV caches: one row (`RotatingKVCache`) and a left-padded batch of rows
(`BatchRotatingKVCache`), for layers that attend over the last `max_size` positions only.

The solo cache is mlx-lm's RotatingKVCache (keep = 0) op for op, so a solo row computes what
mlx_lm.generate does: a multi-token update keeps the last `max_size - 1` positions in temporal
order and appends; a one-token update writes into a ring of `max_size` slots. Once the ring has
dropped positions it cannot be trimmed back (`is_trimmable`), so a prompt-cache entry of a
wrapped row serves only its exact tokens.

The batch keeps its rows in temporal order like `BatchKVCache` (holes, reject, filter and extend
are that class's) and masks each row to its window; slots every row's window has left are
dropped now and then, so its KV stays near `max_size` positions a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from model.kv.cache import STEP, BatchKVCache, KVCache


def window_mask(N: int, offset: int, window: int) -> mx.array:
    """mlx-lm's create_causal_mask with a window: query i (at offset + i) sees keys j with
    offset + i - window < j <= offset + i."""
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    linds, rinds = linds[:, None], rinds[None]
    return (linds >= rinds) & (linds < rinds + window)


class RotatingKVCache(KVCache):
    """One row's keys/values for a sliding layer; `offset` counts every position fed."""

    spill_kind: str | None = None  # its window is not a prefix: the SSD tier cannot key it

    @classmethod
    def batched(cls, caches: Sequence[Any], quant: Any, mixed: Any) -> BatchRotatingKVCache:
        """A sliding layer's batch (never quantized)."""
        return BatchRotatingKVCache.merge(caches)

    def __init__(self, max_size: int) -> None:
        super().__init__()
        self.max_size = max_size
        self._idx = 0  # the next slot to write (ring), or the slots held (temporal order)

    def _temporal(self, v: mx.array) -> mx.array:
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:  # a ring that wrapped: oldest slots first
            return mx.concatenate([v[..., self._idx :, :], v[..., : self._idx, :]], axis=2)
        return v[..., : self._idx, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def _update_concat(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            held_keys, held_values = self._temporal(self.keys), self._temporal(self.values)
            # Keep max_size - 1 so every new position still sees a whole window.
            trim = held_keys.shape[2] - self.max_size + 1
            if trim > 0:
                held_keys, held_values = held_keys[..., trim:, :], held_values[..., trim:, :]
            self.keys = mx.concatenate([held_keys, keys], axis=2)
            self.values = mx.concatenate([held_values, values], axis=2)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, S, Dk = keys.shape
        prev = self.offset
        if (
            self.keys is None
            or self.values is None
            or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size)
        ):
            size = min(STEP, self.max_size - prev)
            new_k = mx.zeros((B, H, size, Dk), keys.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            self._idx = prev
        trim = self.keys.shape[2] - self.max_size
        if trim > 0:
            self.keys, self.values = self.keys[..., trim:, :], self.values[..., trim:, :]
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = 0
        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self.offset += S
        self._idx += S
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def make_mask(self, N: int) -> mx.array | str | None:  # type: ignore[override]  # (a windowed array too)
        if N == 1:
            return None  # the ring holds exactly the window
        offset = min(self.max_size - 1, self.offset)
        return window_mask(N, offset, self.max_size) if offset + N > self.max_size else "causal"

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size  # nothing dropped yet

    def _held(self) -> int:
        """Positions held in temporal order; -1 for a ring that wrapped."""
        if self.keys is None:
            return 0
        if self._idx == self.offset or self._idx == self.keys.shape[2]:
            return self._idx
        return -1

    def trim(self, n: int) -> int:
        """Drop the last `n` positions. Done only where what stays still holds a whole window
        (before wrapping, or right after a multi-token update); else 0, nothing changed."""
        n = min(self.offset, n)
        held = self._held()
        if n <= 0 or held < n or held - n < min(self.max_size, self.offset - n):
            return 0
        assert self.keys is not None and self.values is not None
        self.keys, self.values = self.keys[..., : held - n, :], self.values[..., : held - n, :]
        self.offset -= n
        self._idx = held - n
        return n

    def row(self, i: int, length: int) -> RotatingKVCache:
        """Row i's first `length` positions (of a batch that never dropped any) as a copy."""
        if self._held() != self.offset:
            raise ValueError("row() needs a cache holding every position")
        cache = RotatingKVCache(self.max_size)
        if self.keys is not None and self.values is not None:
            cache.keys = mx.contiguous(self.keys[i : i + 1, :, :length])
            cache.values = mx.contiguous(self.values[i : i + 1, :, :length])
            cache.offset = cache._idx = length
        return cache

    def clone(self) -> RotatingKVCache:
        other = RotatingKVCache(self.max_size)
        if self.keys is not None and self.values is not None:
            # New array objects over the same buffers: a write to either side copies.
            other.keys, other.values = self.keys[:], self.values[:]
        other.offset, other._idx = self.offset, self._idx
        return other

    def window(self) -> tuple[mx.array, mx.array] | None:
        """The last min(offset, max_size) positions' keys and values, oldest first."""
        if self.keys is None or self.values is None or self.offset == 0:
            return None
        n = min(self.offset, self.max_size)
        return self._temporal(self.keys)[..., -n:, :], self._temporal(self.values)[..., -n:, :]


class BatchRotatingKVCache(BatchKVCache):
    """Left-padded rows of a sliding layer; `offset[i]` is row i's position (RoPE), `lost[i]`
    (host) how many of its positions were dropped from the front."""

    def __init__(self, max_size: int, left_padding: Sequence[int]) -> None:
        super().__init__(left_padding)
        self.max_size = max_size
        self.lost = [0] * len(self.pads)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> BatchRotatingKVCache:
        solo = [c for c in caches if isinstance(c, RotatingKVCache)]
        if len(solo) != len(caches) or len({c.max_size for c in solo}) != 1:
            raise ValueError("a sliding layer's rows must all be RotatingKVCaches of one size")
        windows = [c.window() for c in solo]
        lengths = [0 if w is None else w[0].shape[2] for w in windows]
        width = max(lengths)
        batch = cls(solo[0].max_size, [width - n for n in lengths])
        batch.lost = [c.offset - n for c, n in zip(solo, lengths)]
        batch.offset = mx.array([c.offset for c in solo])
        ref = next((w for w in windows if w is not None), None)
        if ref is None:
            return batch
        B, (_, H, _, Dk), Dv = len(solo), ref[0].shape, ref[1].shape[3]
        keys = mx.zeros((B, H, width, Dk), dtype=ref[0].dtype)
        values = mx.zeros((B, H, width, Dv), dtype=ref[1].dtype)
        for i, (p, w) in enumerate(zip(batch.pads, windows)):
            if w is not None:
                keys[i : i + 1, :, p:] = w[0]
                values[i : i + 1, :, p:] = w[1]
        batch.keys, batch.values, batch._idx = keys, values, width
        return batch

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fetched = super().update_and_fetch(keys, values)
        # Slots before _idx - max_size - N are outside every window from here on, even after a
        # speculative reject of N - 1 of these positions. Dropped in batches: each drop copies.
        dead = self._idx - self.max_size - keys.shape[2]
        if self.holes is None and dead >= self.max_size:
            self._drop_front(dead)
        return fetched

    def _drop_front(self, t: int) -> None:
        assert self.keys is not None and self.values is not None
        n = self._idx - t
        B, H, _, Dk = self.keys.shape
        size = -(-n // STEP) * STEP
        keys = mx.zeros((B, H, size, Dk), self.keys.dtype)
        values = mx.zeros((B, H, size, self.values.shape[3]), self.values.dtype)
        keys[..., :n, :] = self.keys[..., t : self._idx, :]
        values[..., :n, :] = self.values[..., t : self._idx, :]
        self.keys, self.values, self._idx = keys, values, n
        self.lost = [lost + max(0, t - p) for lost, p in zip(self.lost, self.pads)]
        self.pads = [max(0, p - t) for p in self.pads]
        self.left_padding = mx.array(self.pads)

    def make_mask(self, N: int) -> mx.array:
        mask = super().make_mask(N)
        distance = mx.arange(self._idx, self._idx + N)[:, None] - mx.arange(self._idx + N)[None]
        if self.holes is None or self._holes_dev is None:
            return mask & (distance < self.max_size)
        # Speculative holes are slots, not positions: a key's distance in positions leaves out
        # the holes between it and the query.
        holes = mx.concatenate([self._holes_dev.astype(mx.int32), mx.zeros((self.size, N), mx.int32)], axis=1)
        after = mx.sum(holes, axis=1, keepdims=True) - mx.cumsum(holes, axis=1)
        return mask & ((distance[None] - after[:, None, :]) < self.max_size)[:, None]

    def filter(self, keep: Sequence[int]) -> None:
        self.lost = [self.lost[i] for i in keep]
        super().filter(keep)

    def extend(self, other: BatchKVCache) -> None:
        assert isinstance(other, BatchRotatingKVCache) and other.max_size == self.max_size
        lost = self.lost + other.lost
        super().extend(other)
        self.lost = lost

    def extract(self, i: int) -> RotatingKVCache:
        """Row i as a solo cache in temporal order (a copy), at its true position."""
        row = super().extract(i)
        cache = RotatingKVCache(self.max_size)
        if row.keys is not None:
            cache.keys, cache.values = row.keys, row.values
            cache._idx = row.offset
        cache.offset = self.lost[i] + row.offset
        return cache

    def to_solo(self) -> RotatingKVCache:
        return self.extract(0)
