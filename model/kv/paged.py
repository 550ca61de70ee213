"""Paged KV for full-attention layers (`--paged-kv`): a batch kind (`PagedBatchKVCache`) whose
rows' keys and values live in a per-layer pool of fixed blocks, each row holding a table of its
blocks.

Why: the contiguous batch (cache.py `BatchKVCache`) pads every row to the longest one and copies
the whole batch's KV whenever a row joins or leaves. Here a row holds ceil(length / BLOCK) blocks
of its own: a joining row copies only its own KV in, a leaving row's blocks go back to the pool
without a copy, and the live-KV budget bills each row by the blocks it holds (actors/kv_memory.py).

Layout: per layer, `keys` / `values` pools [blocks, kv_heads, BLOCK, head_dim] in the activation
dtype; row i's position p is slot p % BLOCK of block `tables[i][p // BLOCK]`. The pool grows by
whole blocks and is compacted when most of it is free, so what it holds stays near what its rows
hold (`nbytes` is the latter).

Attention (`attend`): a one-position decode step on CUDA reads the pool through the block table
(model/kv/paged_kernel.py, once its first-use check passed). Everything else (CPU, Metal, a
speculative verification's several positions) gathers each row's blocks into `BatchKVCache`'s
layout — right-aligned at the longest row's length, the padding masked — and calls the layer's
own attention: the very arrays the contiguous batch would hold, so the result is the same.

Rows come in as solo `KVCache`s (`merge`, `extend`) and leave as them (`extract`, `row`,
`to_solo`), so the prompt cache, the SSD tier and snapshots never see a pool. Only a batch of
rows is paged: a lone row keeps its solo cache (the serial graph), with or without the flag.
Sliding-window, recurrent-state and quantized layers keep their own kinds (model/kv/rows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from model.kv import paged_kernel
from model.kv.cache import STEP, Attend, KVCache, causal_mask

# Positions per block: the contiguous caches' growth step, so a paged row holds (and is billed)
# exactly what the same row alone holds.
BLOCK = STEP


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _as_blocks(x: mx.array, n: int) -> mx.array:
    """A solo cache's buffer [1, H, capacity, D] holding `n` positions as [blocks, H, BLOCK, D]
    (slots past `n` hold whatever the buffer had there: never attended)."""
    _, H, cap, D = x.shape
    width = _blocks(n) * BLOCK
    x = x[..., :width, :] if cap >= width else mx.pad(x[..., :n, :], [(0, 0), (0, 0), (0, width - n), (0, 0)])
    return x.reshape(H, width // BLOCK, BLOCK, D).transpose(1, 0, 2, 3)


# The last step's write rows: every layer of a batch holds the same tables (they allocate alike),
# so a step's layers share one upload instead of one each.
_last_write: tuple[tuple[tuple[int, ...], int], mx.array] | None = None


def _write_rows(slots: tuple[int, ...], heads: int) -> mx.array:
    """Rows (block * H + head) * BLOCK + slot of the pool viewed as [blocks * H * BLOCK, D], for
    each (row, position) slot `block * H * BLOCK + slot` and head, in [B, N, H] order."""
    global _last_write
    if _last_write is None or _last_write[0] != (slots, heads):
        rows = np.array(slots, np.int64)[:, None] + np.arange(heads) * BLOCK
        _last_write = ((slots, heads), mx.array(rows.reshape(-1).astype(np.int32)))
    return _last_write[1]


class PagedBatchKVCache:
    """One full-attention layer's rows in a block pool. `lengths[i]`: positions row i holds;
    `tables[i]`: its blocks, in position order; `free`: the pool's unused blocks."""

    spill_kind: str | None = None

    def __init__(self) -> None:
        self.keys: mx.array | None = None  # [blocks, H, BLOCK, Dk]
        self.values: mx.array | None = None  # [blocks, H, BLOCK, Dv]
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        self.free: list[int] = []  # descending, so the lowest block is taken first
        # Device copies, rebuilt when the host side changes (None = stale): positions (RoPE's
        # offsets), left padding of the gathered layout, block table.
        self._offset: mx.array | None = None
        self._pads: mx.array | None = None
        self._table: mx.array | None = None

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> PagedBatchKVCache:
        batch = cls()
        batch._add_rows(caches)
        return batch

    # -- the host side: blocks and rows ----------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Blocks the pool has room for (held and free)."""
        return 0 if self.keys is None else int(self.keys.shape[0])

    @property
    def held_blocks(self) -> int:
        return sum(len(t) for t in self.tables)

    def _changed(self) -> None:
        self._offset = self._pads = self._table = None

    def _grow(self, missing: int, keys: mx.array, values: mx.array) -> None:
        """Room for `missing` more blocks, shaped like `keys` / `values` ([.., H, .., D]). At least
        one block a row: the rows cross block ends at different steps, so one growth serves the
        next crossings, as one 256-slot growth of the contiguous batch serves 256 steps."""
        extra = max(missing, self.size, 1)
        start = self.capacity

        def grown(pool: mx.array | None, like: mx.array) -> mx.array:
            fresh = mx.zeros((extra, like.shape[1], BLOCK, like.shape[-1]), like.dtype)
            return fresh if pool is None else mx.concatenate([pool, fresh])

        self.keys, self.values = grown(self.keys, keys), grown(self.values, values)
        self.free = sorted(self.free + list(range(start, start + extra)), reverse=True)

    def _allocate(self, count: int, keys: mx.array, values: mx.array) -> list[int]:
        if count > len(self.free):
            self._grow(count - len(self.free), keys, values)
        taken = self.free[len(self.free) - count :][::-1]
        del self.free[len(self.free) - count :]
        return taken

    def _release(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.free = sorted(self.free + list(blocks), reverse=True)

    def _compact_if_sparse(self) -> None:
        """When the free blocks outnumber the held ones (and a growth's worth), copy the held
        blocks into a pool of their own: rows that left must not pin the pool at its peak."""
        held = self.held_blocks
        if self.keys is None or self.values is None or len(self.free) <= held + self.size:
            return
        if not held:
            self.keys = self.values = None
            self.free = []
            self._changed()
            return
        used = sorted(b for t in self.tables for b in t)
        where = {b: n for n, b in enumerate(used)}
        idx = mx.array(used)
        self.keys, self.values = self.keys[idx], self.values[idx]
        self.tables = [[where[b] for b in t] for t in self.tables]
        self.free = []
        self._changed()

    def _add_rows(self, caches: Sequence[KVCache]) -> None:
        """Append rows given as solo caches: their positions copied into blocks of the pool."""
        parts_k, parts_v, counts = [], [], []
        for c in caches:
            n = c.offset if c.keys is not None else 0
            if n:
                assert c.keys is not None and c.values is not None
                parts_k.append(_as_blocks(c.keys, n))
                parts_v.append(_as_blocks(c.values, n))
            counts.append(_blocks(n))
            self.lengths.append(n)
        ids: list[int] = []
        if parts_k:
            ids = self._allocate(sum(counts), parts_k[0], parts_v[0])
            assert self.keys is not None and self.values is not None
            where = mx.array(ids)
            self.keys[where] = mx.concatenate(parts_k) if len(parts_k) > 1 else parts_k[0]
            self.values[where] = mx.concatenate(parts_v) if len(parts_v) > 1 else parts_v[0]
        start = 0
        for count in counts:
            self.tables.append(ids[start : start + count])
            start += count
        self._changed()

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the rows at `keep` (in that order); the others' blocks go back to the pool."""
        kept = set(keep)
        self._release([b for i, t in enumerate(self.tables) if i not in kept for b in t])
        self.tables = [self.tables[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self._changed()
        self._compact_if_sparse()

    def extend(self, other: PagedBatchKVCache) -> None:
        """Append `other`'s rows: their blocks copied into this pool (one gather, one scatter)."""
        source = [b for t in other.tables for b in t]
        ids: list[int] = []
        if source:
            assert other.keys is not None and other.values is not None
            ids = self._allocate(len(source), other.keys, other.values)
            assert self.keys is not None and self.values is not None
            where, src = mx.array(ids), mx.array(source)
            self.keys[where] = other.keys[src]
            self.values[where] = other.values[src]
        moved = dict(zip(source, ids))
        self.tables += [[moved[b] for b in t] for t in other.tables]
        self.lengths += other.lengths
        self._changed()

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """After a forward of `fed` positions per row, row i keeps its first `kept[i]`: the rest
        are dropped (a row's positions are its own, so no holes), blocks past its end freed."""
        for i, k in enumerate(kept):
            self.lengths[i] -= fed - k
            surplus = self.tables[i][_blocks(self.lengths[i]) :]
            del self.tables[i][_blocks(self.lengths[i]) :]
            self._release(surplus)
        self._changed()

    # -- the device side ---------------------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Each row's next position (RoPE's offsets), as a contiguous batch's `offset`."""
        if self._offset is None:
            self._offset = mx.array(self.lengths, mx.int32)
        return self._offset

    def _width(self) -> int:
        return max(self.lengths, default=0)

    def _left_padding(self) -> mx.array:
        """Each row's padding in the gathered layout (width = the longest row). A step advances
        every row alike, so it changes only when rows come, go or take drafts back."""
        if self._pads is None:
            width = self._width()
            self._pads = mx.array([width - n for n in self.lengths], mx.int32)
        return self._pads

    def block_table(self) -> mx.array:
        """[rows, most blocks a row holds] int32; a shorter row's table is padded with block 0."""
        if self._table is None:
            table = np.zeros((self.size, max(1, max(map(len, self.tables), default=0))), np.int32)
            for i, t in enumerate(self.tables):
                table[i, : len(t)] = t
            self._table = mx.array(table)
        return self._table

    def make_mask(self, N: int) -> mx.array:
        """`BatchKVCache.make_mask` of the gathered layout (no holes: a rejected draft is dropped)."""
        return causal_mask(N, self._width(), left_padding=self._left_padding())

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """Store N new positions per row ([B, H, N, D]) at each row's end, taking blocks as
        rows cross block ends."""
        B, H, N, Dk = keys.shape
        for i in range(B):
            missing = _blocks(self.lengths[i] + N) - len(self.tables[i])
            if missing > 0:
                self.tables[i] += self._allocate(missing, keys, values)
                self._table = None
        assert self.keys is not None and self.values is not None
        slots = tuple(
            self.tables[i][p // BLOCK] * H * BLOCK + p % BLOCK
            for i in range(B)
            for p in range(self.lengths[i], self.lengths[i] + N)
        )
        idx = _write_rows(slots, H)
        for name, new in (("keys", keys), ("values", values)):
            pool: mx.array = getattr(self, name)
            flat = pool.reshape(-1, pool.shape[-1])
            flat[idx] = new.transpose(0, 2, 1, 3).reshape(-1, new.shape[-1])
            setattr(self, name, flat.reshape(pool.shape))
        self.lengths = [n + N for n in self.lengths]
        if self._offset is not None:
            self._offset = self._offset + N  # (on the device: no upload per step)

    def _gathered(self) -> tuple[mx.array, mx.array]:
        """Every row's positions in the contiguous batch's layout: [B, H, width, D], row i
        right-aligned after `width - lengths[i]` padding slots (which read its position 0)."""
        assert self.keys is not None and self.values is not None
        H, width = self.keys.shape[1], self._width()
        pos = mx.maximum(mx.arange(width)[None] - self._left_padding()[:, None], 0)  # [B, width]
        block = mx.take_along_axis(self.block_table(), pos // BLOCK, axis=1)
        base = block * (H * BLOCK) + pos % BLOCK
        idx = base[:, None, :] + (mx.arange(H, dtype=mx.int32) * BLOCK)[None, :, None]  # [B, H, width]
        return (
            mx.take(self.keys.reshape(-1, self.keys.shape[-1]), idx, axis=0),
            mx.take(self.values.reshape(-1, self.values.shape[-1]), idx, axis=0),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's positions; every row's keys and values in the contiguous layout."""
        self._write(keys, values)
        return self._gathered()

    def _kernel_ready(self, queries: mx.array, N: int) -> bool:
        return N == 1 and self.keys is not None and paged_kernel.usable(queries, self.keys, self.values)

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Attend
    ) -> mx.array:
        """Store the step's keys and values, then attend: on CUDA a decode step through the block
        table; otherwise the layer's own attention over the gathered rows, with this layout's mask
        (the model's may be another kind's)."""
        N = keys.shape[2]
        if self._kernel_ready(queries, N):
            self._write(keys, values)
            assert self.keys is not None and self.values is not None
            table, lengths = self.block_table(), self.offset
            return paged_kernel.decode_attention(queries, self.keys, self.values, table, lengths, scale)
        own_mask = self.make_mask(N)
        stored_keys, stored_values = self.update_and_fetch(keys, values)
        return attend(queries, stored_keys, stored_values, own_mask)

    def store(self, keys: mx.array, values: mx.array, scale: float) -> Callable[[mx.array], mx.array]:
        """Store the step's keys and values; attention over them as a function of the queries,
        for this layer and the layers that share its KV (model/kv/shared.py)."""
        N = keys.shape[2]
        own_mask = self.make_mask(N)
        self._write(keys, values)
        assert self.keys is not None and self.values is not None
        pools = (self.keys, self.values, self.block_table(), self.offset)
        gathered = self._gathered()  # (lazy: never computed when the kernel attends)

        def attend(queries: mx.array) -> mx.array:
            if N == 1 and paged_kernel.usable(queries, pools[0], pools[1]):
                return paged_kernel.decode_attention(queries, *pools, scale)
            return mx.fast.scaled_dot_product_attention(queries, *gathered, scale=scale, mask=own_mask)

        return attend

    @property
    def state(self) -> list[mx.array]:
        pools = [] if self.keys is None or self.values is None else [self.keys, self.values]
        return [self.offset, *pools]

    @property
    def nbytes(self) -> int:
        """The blocks the rows hold (a bounded slack of free blocks is the pool's, not theirs)."""
        if self.keys is None or self.values is None or not self.capacity:
            return 0
        return self.held_blocks * ((self.keys.nbytes + self.values.nbytes) // self.capacity)

    # -- rows out as solo caches --------------------------------------------------------------------

    def _row_blocks(self, i: int) -> tuple[mx.array, mx.array] | None:
        """Row i's blocks as one buffer each, [1, H, blocks * BLOCK, D] (a copy); None if empty."""
        if not self.tables[i] or self.keys is None or self.values is None:
            return None
        idx = mx.array(self.tables[i])

        def joined(pool: mx.array) -> mx.array:
            blocks = pool[idx]  # [n, H, BLOCK, D]
            n, H, _, D = blocks.shape
            return blocks.transpose(1, 0, 2, 3).reshape(1, H, n * BLOCK, D)

        return joined(self.keys), joined(self.values)

    def row(self, i: int, length: int) -> KVCache:
        """Row i's first `length` positions as a solo cache of exactly that many (a copy)."""
        cache = KVCache()
        blocks = self._row_blocks(i)
        if blocks is not None and length:
            cache.keys = mx.contiguous(blocks[0][..., :length, :])
            cache.values = mx.contiguous(blocks[1][..., :length, :])
            cache.offset = length
        return cache

    def extract(self, i: int) -> KVCache:
        return self.row(i, self.lengths[i])

    def to_solo(self) -> KVCache:
        """A one-row batch as a solo cache: its blocks joined into one buffer whose capacity is a
        multiple of BLOCK, as a solo row's grows (a capacity CUDA's warm-up met)."""
        assert self.size == 1
        solo = KVCache()
        blocks = self._row_blocks(0)
        if blocks is not None:
            solo.keys, solo.values = blocks
            solo.offset = self.lengths[0]
        return solo
