"""Fixed-size recurrent state caches for linear-attention layers (model/nn/gated_delta.py): one row
(`StateCache`) and a batch of rows stacked (`BatchStateCache`).

A layer's state is a convolution tail (the last kernel-1 inputs) and a recurrent matrix per head:
its size does not grow with the sequence, and it cannot be rewound, so these caches are never
trimmable (`trim` drops nothing). A prompt-cache entry of a hybrid model therefore serves only a
prompt that extends exactly the tokens it covers, and a snapshot must be taken where the state
is, never trimmed back to (model/engine/snapshots.py's trimmed clones come back short: no put, a miss).

A batch holds only decode rows, one token each per step: no padding ever enters a state. A group
prefill (right-padded rows in one forward) leaves each row's state polluted by its padding, so the
layer keeps its input (`replay`) and `row(i, n)` recomputes row i's state over its own n tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

# replay(x, cache): run the layer's recurrence over inputs x ([1, n, hidden]) into `cache`.
Replay = Callable[[mx.array, "StateCache"], None]


class StateCache:
    """One row's state for one linear-attention layer; `offset` counts the tokens fed."""

    spill_kind: str | None = None

    def __init__(self) -> None:
        self.conv: mx.array | None = None  # [1, kernel - 1, conv_dim]
        self.recurrent: mx.array | None = None  # [1, heads, Dv, Dk], float32
        self.offset = 0
        self.replay: tuple[Replay, mx.array, StateCache] | None = None  # (a group prefill's)

    def update(self, conv: mx.array, recurrent: mx.array, fed: int) -> None:
        self.conv, self.recurrent = conv, recurrent
        self.offset += fed

    @classmethod
    def batched(cls, caches: Sequence[Any], quant: Any, mixed: Any) -> BatchStateCache:
        """A linear-attention layer's batch of states (never quantized)."""
        return BatchStateCache.merge(caches)

    def before_forward(self, replay: Replay, x: mx.array) -> None:
        """A forward of input `x` begins. A group prefill's rows may be right-padded, so each
        row's own state is recomputed from this input when it is split off (`row`)."""
        if x.shape[0] > 1 and x.shape[1] > 1:
            self.replay = (replay, x, self.clone())

    def make_mask(self, N: int) -> None:
        return None

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Any
    ) -> mx.array:
        raise TypeError("a recurrent state holds no keys: its layer is not an attention layer")

    @property
    def state(self) -> list[mx.array]:
        return [] if self.conv is None or self.recurrent is None else [self.conv, self.recurrent]

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def clone(self) -> StateCache:
        # Arrays are values and updates replace them: sharing them is a copy.
        other = StateCache()
        other.conv, other.recurrent, other.offset = self.conv, self.recurrent, self.offset
        return other

    def row(self, i: int, length: int) -> StateCache:
        """Row i of a forward over several rows, as if it had been fed only its first `length`
        tokens (a right-padded group prefill: recomputed from the layer's kept input)."""
        cache = StateCache()
        if length == self.offset or self.replay is None:
            if length != self.offset:
                raise ValueError("a state cannot be cut back to fewer tokens than it was fed")
            if self.conv is not None and self.recurrent is not None:
                cache.conv = mx.contiguous(self.conv[i : i + 1])
                cache.recurrent = mx.contiguous(self.recurrent[i : i + 1])
            cache.offset = length
            return cache
        replay, x, start = self.replay
        cache = start.row(i, start.offset) if start.conv is not None else cache
        cache.offset = start.offset
        replay(x[i : i + 1, : length - start.offset], cache)
        return cache

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class BatchStateCache:
    """Decode rows' states for one linear-attention layer, stacked along axis 0."""

    spill_kind: str | None = None

    def __init__(self, offsets: Sequence[int]) -> None:
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.offsets = [int(n) for n in offsets]  # host copy: tokens each row has fed

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets)

    def before_forward(self, replay: Replay, x: mx.array) -> None:
        """Decode steps feed one token a row: nothing to replay."""

    @property
    def size(self) -> int:
        return len(self.offsets)

    @classmethod
    def merge(cls, caches: Sequence[StateCache]) -> BatchStateCache:
        if not all(isinstance(c, StateCache) for c in caches):
            raise ValueError("a linear-attention layer's rows must all be StateCaches")
        batch = cls([c.offset for c in caches])
        ref = next((c for c in caches if c.conv is not None and c.recurrent is not None), None)
        if ref is None:
            return batch
        assert ref.conv is not None and ref.recurrent is not None
        # A row that has fed nothing starts from zeros: what the layer uses for a missing state.
        batch.conv = mx.concatenate([ref.conv * 0 if c.conv is None else c.conv for c in caches])
        batch.recurrent = mx.concatenate([ref.recurrent * 0 if c.recurrent is None else c.recurrent for c in caches])
        return batch

    def update(self, conv: mx.array, recurrent: mx.array, fed: int) -> None:
        self.conv, self.recurrent = conv, recurrent
        self.offsets = [n + fed for n in self.offsets]

    def make_mask(self, N: int) -> None:
        return None

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Any
    ) -> mx.array:
        raise TypeError("a recurrent state holds no keys: its layer is not an attention layer")

    @property
    def state(self) -> list[mx.array]:
        return [] if self.conv is None or self.recurrent is None else [self.conv, self.recurrent]

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def filter(self, keep: Sequence[int]) -> None:
        idx = mx.array(list(keep))
        if self.conv is not None and self.recurrent is not None:
            self.conv, self.recurrent = self.conv[idx], self.recurrent[idx]
        self.offsets = [self.offsets[i] for i in keep]

    def extend(self, other: BatchStateCache) -> None:
        mine, theirs = self._filled(), other._filled()
        if mine is None or theirs is None:
            ref = mine or theirs
            if ref is not None:  # one side fed nothing yet: zeros of the other's shape
                zeros = (ref[0][:1] * 0, ref[1][:1] * 0)
                mine = mine or (mx.repeat(zeros[0], self.size, 0), mx.repeat(zeros[1], self.size, 0))
                theirs = theirs or (mx.repeat(zeros[0], other.size, 0), mx.repeat(zeros[1], other.size, 0))
        if mine is not None and theirs is not None:
            self.conv = mx.concatenate([mine[0], theirs[0]])
            self.recurrent = mx.concatenate([mine[1], theirs[1]])
        self.offsets = self.offsets + other.offsets

    def _filled(self) -> tuple[mx.array, mx.array] | None:
        return None if self.conv is None or self.recurrent is None else (self.conv, self.recurrent)

    def extract(self, i: int) -> StateCache:
        cache = StateCache()
        if self.conv is not None and self.recurrent is not None:
            cache.conv = mx.contiguous(self.conv[i : i + 1])
            cache.recurrent = mx.contiguous(self.recurrent[i : i + 1])
        cache.offset = self.offsets[i]
        return cache

    def to_solo(self) -> StateCache:
        return self.extract(0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)
