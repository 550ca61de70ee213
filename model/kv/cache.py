"""Per-layer KV caches: one row (`KVCache`) and a left-padded batch of rows (`BatchKVCache`).

Layouts and update rules follow mlx-lm's cache.py (the parity oracle): storage grows in 256-slot
steps along the sequence axis; a batch is right-aligned with a per-row `left_padding`, so RoPE
gets per-row positions (`offset` is an array) and the mask hides each row's padding.

MLX arrays are immutable values, so a clone is a new cache object holding slices of the same
buffers: cheap, and writes to either side never show through to the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

STEP = 256


def causal_mask(N: int, offset: int, left_padding: mx.array | None = None) -> mx.array:
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    mask = linds[:, None] >= rinds[None]
    if left_padding is not None:
        mask = mask & (mx.expand_dims(left_padding, (1, 2, 3)) <= rinds)
    return mask


def _grow(store: mx.array | None, used: int, incoming: mx.array) -> mx.array:
    """A buffer holding `store`'s first `used` positions with room for `incoming`, its capacity
    a multiple of STEP. A cold sequence grows exactly as mlx-lm's cache does; a trimmed, cloned
    or restored one (used not a multiple) is rounded up to the same capacities too, because on
    CUDA the first decode against a buffer of a new capacity costs ~0.4 s (H200) and warm-up
    meets only multiples of STEP (model/engine/warm_up.py)."""
    B, H, n, D = incoming.shape
    if store is None:
        return mx.zeros((B, H, -(-n // STEP) * STEP, D), incoming.dtype)
    if used % STEP != 0:
        store = store[..., :used, :]
    fresh = mx.zeros((B, H, -(-(used + n) // STEP) * STEP - used, D), incoming.dtype)
    return mx.concatenate([store, fresh], axis=2)


# A layer's own attention: (queries, keys, values, mask) -> attended. A cache that stores its KV in
# another form (quantized) attends itself instead.
Attend = Callable[[mx.array, mx.array, mx.array, Any], mx.array]
# (layer quant, rows' solo caches) -> a batch whose rows turn quantized one by one (model/kv/mixed.py).
MixedMerge = Callable[[Any, Sequence[Any]], Any]


class KVCache:
    """One sequence's keys/values for one layer; trimmable; `offset` is an int."""

    # How the SSD tier stores it ("kv": keys and values in the activation dtype); None: it is
    # not stored there (a sliding window, a batch, a recurrent state).
    spill_kind: str | None = "kv"

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Attend
    ) -> mx.array:
        """Store the step's keys and values, then attend over everything the cache holds."""
        stored_keys, stored_values = self.update_and_fetch(keys, values)
        return attend(queries, stored_keys, stored_values, mask)

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """Drop the draft positions a verification did not keep: of the `fed` positions the last
        forward stored, the first `kept[0]` stay (one row)."""
        self.trim(fed - kept[0])

    @classmethod
    def batched(cls, caches: Sequence[Any], quant: Any, mixed: MixedMerge | None) -> Any:
        """One layer's batch cache from its rows' solo caches (this kind first): a plain batch, or
        under a quantizing scheme (`mixed`: model/kv/mixed.py's merge) one whose rows turn
        quantized one by one."""
        return BatchKVCache.merge(caches) if mixed is None else mixed(quant, caches)

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        # Slots of the buffer `keys` is a view of, when it is one (a clone): an MLX slice keeps
        # its whole source buffer alive, so that is the memory this cache really holds.
        self.pinned_slots = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        stored_keys, stored_values = self.keys, self.values
        if stored_keys is None or stored_values is None or prev + keys.shape[2] > stored_keys.shape[2]:
            stored_keys = self.keys = _grow(stored_keys, prev, keys)
            stored_values = self.values = _grow(stored_values, prev, values)
            self.pinned_slots = 0  # a fresh buffer: no view is held any more
        self.offset += keys.shape[2]
        stored_keys[..., prev : self.offset, :] = keys
        stored_values[..., prev : self.offset, :] = values
        if self.offset < stored_keys.shape[2]:
            return stored_keys[..., : self.offset, :], stored_values[..., : self.offset, :]
        return stored_keys, stored_values

    def row(self, i: int, length: int) -> KVCache:
        """Row i's first `length` positions as a one-row cache of its own (a copy)."""
        cache = KVCache()
        if self.keys is not None and self.values is not None:
            cache.keys = mx.contiguous(self.keys[i : i + 1, :, :length])
            cache.values = mx.contiguous(self.values[i : i + 1, :, :length])
            cache.offset = length
        return cache

    def make_mask(self, N: int) -> str | None:
        # None / "causal" let the fused kernel build the mask (mlx-lm's choice, same numerics).
        return None if N == 1 else "causal"

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def clone(self) -> KVCache:
        other = KVCache()
        if self.keys is not None and self.values is not None:
            other.keys = self.keys[..., : self.offset, :]
            other.values = self.values[..., : self.offset, :]
            other.pinned_slots = max(self.keys.shape[2], self.pinned_slots)
        other.offset = self.offset
        return other

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        # Bytes of the buffer held: the grown buffer's spare slots, or a view's whole source
        # buffer, count too, so a byte cap bounds real memory (clones sharing one buffer are
        # each charged for it: an over-count, never an under-count).
        slots = self.keys.shape[2]
        per_slot = self.keys.nbytes // slots + self.values.nbytes // self.values.shape[2]
        return per_slot * max(slots, self.pinned_slots)


class BatchKVCache:
    """Left-padded rows for one layer. `offset[i]` = row i's next position; `_idx` = slots used."""

    spill_kind: str | None = None

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Attend
    ) -> mx.array:
        """Store the step's keys and values, then attend over everything the cache holds."""
        stored_keys, stored_values = self.update_and_fetch(keys, values)
        return attend(queries, stored_keys, stored_values, mask)

    def __init__(self, left_padding: Sequence[int]) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # The padding lives on the host too: reading the device copy back (filter, extract)
        # would wait for the in-flight decode step and stall the pipeline at every row leave.
        self.pads: list[int] = [int(p) for p in left_padding]
        self.left_padding = mx.array(self.pads)
        self.offset = mx.array([-p for p in self.pads])
        self._idx = 0
        # Slots a row does not use, right of its padding: the drafts a speculative verification
        # rejected (`reject`). None = none; else host bools [rows, _idx], mirrored on the device.
        self.holes: np.ndarray | None = None
        self._holes_dev: mx.array | None = None

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> BatchKVCache:
        lengths = [c.offset for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches))
        padding = [max_length - n for n in lengths]
        ref_keys, ref_values = next((c.keys, c.values) for c in caches if c.keys is not None)
        assert ref_keys is not None and ref_values is not None  # keys and values are set together
        _, H, _, Dk = ref_keys.shape
        Dv = ref_values.shape[3]
        keys = mx.zeros((len(caches), H, max_length, Dk), dtype=ref_keys.dtype)
        values = mx.zeros((len(caches), H, max_length, Dv), dtype=ref_values.dtype)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None or c.values is None:
                continue
            keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
        batch = cls(padding)
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + max_length
        batch._idx = max_length
        return batch

    @property
    def size(self) -> int:
        return int(self.left_padding.shape[0])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self._idx
        stored_keys, stored_values = self.keys, self.values
        if stored_keys is None or stored_values is None or prev + keys.shape[2] > stored_keys.shape[2]:
            stored_keys = self.keys = _grow(stored_keys, prev, keys)
            stored_values = self.values = _grow(stored_values, prev, values)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        stored_keys[..., prev : self._idx, :] = keys
        stored_values[..., prev : self._idx, :] = values
        return stored_keys[..., : self._idx, :], stored_values[..., : self._idx, :]

    def make_mask(self, N: int) -> mx.array:
        mask = causal_mask(N, self._idx, left_padding=self.left_padding)
        if self.holes is None:
            return mask
        if self._holes_dev is None or self._holes_dev.shape[1] != self._idx:
            self._holes_dev = mx.array(self._holes_upto())
        used = mx.concatenate([~self._holes_dev, mx.ones((self.size, N), mx.bool_)], axis=1)
        return mask & used[:, None, None, :]

    def _holes_upto(self) -> np.ndarray:
        """`holes` as wide as the slots in use (slots written since the last reject are used)."""
        assert self.holes is not None
        width = self.holes.shape[1]
        if width < self._idx:
            self.holes = np.pad(self.holes, ((0, 0), (0, self._idx - width)))
        return self.holes[:, : self._idx]

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """After a forward of `fed` tokens per row, row i keeps only its first `kept[i]`: the
        rest become holes (masked out from now on) and its position goes back by as many."""
        drop = [fed - k for k in kept]
        if not any(drop):
            return
        if len(set(drop)) == 1 and self.holes is None:  # all alike: plain trim
            self._idx -= drop[0]
            self.offset = self.offset - drop[0]
            return
        holes = np.zeros((len(kept), self._idx), np.bool_) if self.holes is None else self._holes_upto().copy()
        for i, d in enumerate(drop):
            holes[i, self._idx - d : self._idx] = True
        self.holes, self._holes_dev = holes, None
        self.offset = self.offset - mx.array(drop)
        if bool(np.any(np.all(holes, axis=0))):  # slots no row uses: drop them
            self._squeeze()

    def _squeeze(self) -> None:
        assert self.holes is not None and self.keys is not None and self.values is not None
        keep = np.flatnonzero(~np.all(self._holes_upto(), axis=0))
        idx = mx.array(keep)
        self.keys = mx.take(self.keys[..., : self._idx, :], idx, axis=2)
        self.values = mx.take(self.values[..., : self._idx, :], idx, axis=2)
        self.holes = self._holes_upto()[:, keep]
        self._holes_dev = None
        self._idx = len(keep)
        if not self.holes.any():
            self.holes = None

    def _row_slots(self, i: int) -> mx.array | None:
        """Row i's used slots past its padding (None: all of them, contiguous)."""
        if self.holes is None or not self.holes[i].any():
            return None
        return mx.array(np.flatnonzero(~self._holes_upto()[i, self.pads[i] :]) + self.pads[i])

    @property
    def state(self) -> list[mx.array]:
        arrays = [self.offset, self.left_padding]
        return arrays if self.keys is None or self.values is None else arrays + [self.keys, self.values]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep` (in that order), then drop padding no row needs."""
        idx = mx.array(list(keep))
        if self.keys is not None and self.values is not None:
            self.keys = self.keys[idx]
            self.values = self.values[idx]
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        self.pads = [self.pads[i] for i in keep]
        if self.holes is not None:
            self.holes, self._holes_dev = self.holes[list(keep)], None
            if not self.holes.any():
                self.holes = None
        min_pad = min(self.pads)
        if min_pad > 0:
            if self.keys is not None and self.values is not None:
                self.keys = self.keys[..., min_pad:, :]
                self.values = self.values[..., min_pad:, :]
            if self.holes is not None:
                self.holes = self._holes_upto()[:, min_pad:]
            self._idx -= min_pad
            self.left_padding = self.left_padding - min_pad
            self.pads = [p - min_pad for p in self.pads]

    def extend(self, other: BatchKVCache) -> None:
        """Append `other`'s rows, right-justifying both so every row ends at the same slot."""
        if self.holes is not None or other.holes is not None:
            width = max(self._idx, other._idx)

            def holes_of(c: BatchKVCache) -> np.ndarray:
                out = np.zeros((c.size, width), np.bool_)
                if c.holes is not None:
                    out[:, width - c._idx :] = c._holes_upto()
                return out

            self.holes, self._holes_dev = np.concatenate([holes_of(self), holes_of(other)]), None
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self.pads = self.pads + other.pads
            return
        max_idx = max(self._idx, other._idx)
        ref_keys, ref_values = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
        assert ref_keys is not None and ref_values is not None
        _, H, _, Dk = ref_keys.shape
        Dv = ref_values.shape[3]
        max_size = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchKVCache) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None or v is None:
                rows = c.offset.shape[0]
                k = mx.zeros((rows, H, 0, Dk), dtype=ref_keys.dtype)
                v = mx.zeros((rows, H, 0, Dv), dtype=ref_values.dtype)
            left = max_idx - c._idx
            right = max_size - k.shape[2] - left
            if right < 0:
                k, v, right = k[..., :right, :], v[..., :right, :], 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = mx.pad(k, widths), mx.pad(v, widths)
            return k, v, c.offset, c.left_padding + left

        self.pads = [p + max_idx - self._idx for p in self.pads] + [p + max_idx - other._idx for p in other.pads]
        mine, theirs = pad(self), pad(other)
        self.keys, self.values, self.offset, self.left_padding = (mx.concatenate([a, b]) for a, b in zip(mine, theirs))
        self._idx = max_idx

    def extract(self, i: int) -> KVCache:
        """Row i as a solo cache with its padding stripped."""
        pad = self.pads[i]
        cache = KVCache()
        if self.keys is not None and self.values is not None:
            slots = self._row_slots(i)
            if slots is None:
                cache.keys = mx.contiguous(self.keys[i : i + 1, :, pad : self._idx])
                cache.values = mx.contiguous(self.values[i : i + 1, :, pad : self._idx])
            else:
                cache.keys = mx.take(self.keys[i : i + 1], slots, axis=2)
                cache.values = mx.take(self.values[i : i + 1], slots, axis=2)
            cache.offset = cache.keys.shape[2]
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def to_solo(self) -> KVCache:
        """A one-row batch as a solo cache. With no padding it is exactly one: the buffers are
        handed over; a padded row's are views past its padding (pinning the whole buffer)."""
        if self.holes is not None:
            return self.extract(0)
        solo = KVCache()
        if self.keys is not None and self.values is not None:
            pad = self.pads[0]
            solo.keys = self.keys[..., pad:, :] if pad else self.keys
            solo.pinned_slots = self.keys.shape[2] if pad else 0
            solo.values = self.values[..., pad:, :] if pad else self.values
            solo.offset = self._idx - pad
        return solo


class LayerCache(Protocol):
    """One layer's cache, for a solo row or a batch, of any kind in model/kv/ (full-precision,
    quantized, sliding-window, mixed, recurrent state): what every kind answers. An attention
    layer's cache is an `LayerCache`. Kind-specific work (merging rows, quantizing, judging a
    restored prefix) lives in model/kv/ and dispatches there, so no code outside it tests a
    cache's class (tests/test_layers.py checks)."""

    spill_kind: str | None  # how the SSD tier stores it ("kv", "qkv"), None when it cannot

    @property
    def offset(self) -> Any: ...  # positions held: an int for a solo row, an array for a batch

    @property
    def state(self) -> list[mx.array]: ...  # the arrays to evaluate

    @property
    def nbytes(self) -> int: ...

    def make_mask(self, N: int) -> Any: ...  # the attention mask for a forward of N positions

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Attend
    ) -> mx.array:
        """Store a step's keys and values, then attend over all it holds (a quantized kind in its
        own way, through its packed values; a recurrent state refuses: its layer is not attention)."""
        ...


class SoloCache(LayerCache, Protocol):
    """One row's cache of a layer (what a model's `make_caches` gives; a batch's kinds merge
    them, model/kv/rows.py)."""

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...  # drop the last n positions; the number dropped

    def clone(self) -> Any: ...  # an independent cache of the same positions (a snapshot)

    def row(self, i: int, length: int) -> Any: ...  # row i's first `length` positions, alone

    @classmethod
    def batched(cls, caches: Sequence[Any], quant: Any, mixed: MixedMerge | None) -> Any:
        """One layer's batch cache from its rows' solo caches (`quant`: the layer's scheme;
        `mixed`: the merge of a batch whose rows turn quantized, under a quantizing scheme)."""
        ...


def at_capacity(cache: Any, capacity: int) -> Any:
    """A throwaway cache for warm-up to meet one decode step against buffers of `capacity`
    positions (model/engine/warm_up.py): for a prefilled full-precision `KVCache`, zeros of that
    capacity with the next write at its last slot; any other kind (a recurrent state, a sliding
    window, a quantized cache) does not shape its buffers by capacity and is cloned as it is."""
    if type(cache) is not KVCache or cache.keys is None or cache.values is None:
        return cache.clone()
    keys, values = cache.keys, cache.values
    out = KVCache()
    out.keys = mx.zeros((1, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
    out.values = mx.zeros((1, values.shape[1], capacity, values.shape[3]), values.dtype)
    out.offset = capacity - 1
    return out


def make_caches(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]


class PrefixCache(Protocol):
    """Where rows' KV is kept between requests (the prompt cache tiers implement it): `take`
    restores the longest cached prefix of a prompt as clones (None, 0 on a miss); `put` stores
    caches keyed by exactly the tokens they cover, protected from eviction for `retain_s` seconds
    when given (a client's retention hint)."""

    def take(
        self, prompt: Sequence[int], namespace: str = "", min_tokens: int = 1
    ) -> tuple[list[KVCache] | None, int]: ...

    def put(
        self, tokens: Sequence[int], caches: Sequence[KVCache], namespace: str = "", retain_s: float | None = None
    ) -> bool: ...
