"""A batch whose rows turn quantized one by one (`MixedBatchKVCache`): full-precision rows in a
`BatchKVCache`, quantized ones in a `QuantizedBatchKVCache`, each attending over its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from model.kv.cache import Attend, BatchKVCache, KVCache
from model.kv.quant import QUANTIZED_CACHES, QuantizedBatchKVCache, QuantizedKVCache
from model.kv.scheme import LayerQuant


@attrs.frozen
class _Order:
    """Where a mixed batch's rows are: `full` / `quantized` = the batch rows of each part, in the
    part's order; `inverse[i]` = row i's place in the parts' concatenation; `in_order` when that
    concatenation is the batch order (no gathers needed)."""

    full_count: int
    in_order: bool
    full: mx.array
    quantized: mx.array
    inverse: mx.array


class MixedBatchKVCache:
    """One layer of a batch whose rows are some full precision (`full`, a `BatchKVCache`) and
    some quantized (`quant`, a `QuantizedBatchKVCache`); `where[i]` = (quantized?, index within
    that part) of batch row i. Each part attends over its own rows with its own mask, and the
    outputs are put back in batch order. Decode only (L == 1), as every batch runs."""

    spill_kind: str | None = None

    def __init__(self, quant: LayerQuant | None) -> None:
        self.quant = quant  # None: a full-precision layer, whose rows never move
        self.full: BatchKVCache | None = None
        self.quantized: QuantizedBatchKVCache | None = None
        self.where: list[tuple[bool, int]] = []
        self._perm: _Order | None = None

    @classmethod
    def merge(cls, quant: LayerQuant | None, caches: Sequence[KVCache | QuantizedKVCache]) -> MixedBatchKVCache:
        batch = cls(quant)
        full = [c for c in caches if isinstance(c, KVCache)]
        quantized = [c for c in caches if isinstance(c, QuantizedKVCache)]
        batch.full = BatchKVCache.merge(full) if full else None
        if quantized:
            assert quant is not None
            batch.quantized = QuantizedBatchKVCache.merge(quant, quantized)
        counts = [0, 0]
        for c in caches:
            q = isinstance(c, QuantizedKVCache)
            batch.where.append((q, counts[q]))
            counts[q] += 1
        return batch

    @property
    def size(self) -> int:
        return len(self.where)

    def _order(self) -> _Order:
        if self._perm is None:
            full = sorted((i for i, (q, _) in enumerate(self.where) if not q), key=lambda i: self.where[i][1])
            quantized = sorted((i for i, (q, _) in enumerate(self.where) if q), key=lambda i: self.where[i][1])
            inverse = [0] * len(self.where)
            for pos, i in enumerate(full + quantized):
                inverse[i] = pos
            in_order = full + quantized == list(range(len(self.where)))
            self._perm = _Order(len(full), in_order, mx.array(full), mx.array(quantized), mx.array(inverse))
        return self._perm

    def _split(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """`x`'s batch rows as (the full part's rows, the quantized part's rows), each in its part's order."""
        o = self._order()
        if o.in_order:
            return x[: o.full_count], x[o.full_count :]
        return x[o.full], x[o.quantized]

    def _unsplit(self, a: mx.array | None, b: mx.array | None) -> mx.array:
        """The parts' rows back in batch order."""
        o = self._order()
        parts = [p for p in (a, b) if p is not None]
        joined = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return joined if o.in_order else joined[o.inverse]

    @property
    def offset(self) -> mx.array:
        return self._unsplit(
            self.full.offset if self.full is not None else None,
            self.quantized.offset if self.quantized is not None else None,
        )

    def make_mask(self, N: int) -> None:
        return None  # each part masks its own rows in `attend`

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, attend: Attend
    ) -> mx.array:
        (qf, qq), (kf, kq), (vf, vq) = self._split(queries), self._split(keys), self._split(values)
        out_full = out_quant = None
        if self.full is not None:
            full_mask = self.full.make_mask(keys.shape[2])
            k, v = self.full.update_and_fetch(kf, vf)
            out_full = attend(qf, k, v, full_mask)
        if self.quantized is not None:
            out_quant = self.quantized.attend(qq, kq, vq, scale, None, attend)
        return self._unsplit(out_full, out_quant)

    @property
    def state(self) -> list[mx.array]:
        return [a for part in (self.full, self.quantized) if part is not None for a in part.state]

    def _set_where(self, where: list[tuple[bool, int]]) -> None:
        self.where, self._perm = where, None

    def filter(self, keep: Sequence[int]) -> None:
        kept = [self.where[i] for i in keep]
        full_keep = [j for q, j in kept if not q]
        quant_keep = [j for q, j in kept if q]
        self.full = _filtered(self.full, full_keep)
        self.quantized = _filtered(self.quantized, quant_keep)
        full_pos = {j: n for n, j in enumerate(full_keep)}
        quant_pos = {j: n for n, j in enumerate(quant_keep)}
        self._set_where([(q, quant_pos[j] if q else full_pos[j]) for q, j in kept])

    def extend(self, other: MixedBatchKVCache) -> None:
        nf = self.full.size if self.full is not None else 0
        nq = self.quantized.size if self.quantized is not None else 0
        self.full = _extended(self.full, other.full)
        self.quantized = _extended(self.quantized, other.quantized)
        self._set_where(self.where + [(q, j + (nq if q else nf)) for q, j in other.where])

    def extract(self, i: int) -> KVCache | QuantizedKVCache:
        q, j = self.where[i]
        part = self.quantized if q else self.full
        assert part is not None
        return part.extract(j)

    def quantize_rows(self, rows: Sequence[int]) -> None:
        """These batch rows (full precision now) turn quantized: mlx-lm's conversion of a row's
        whole cache, applied to its rows of the batch."""
        moving = [i for i in rows if not self.where[i][0]]
        if not moving or self.full is None or self.quant is None:
            return
        solos = [QuantizedKVCache.from_full(self.full.extract(self.where[i][1]), self.quant) for i in moving]
        incoming = QuantizedBatchKVCache.merge(self.quant, solos)
        stay = [j for j in range(self.full.size) if j not in {self.where[i][1] for i in moving}]
        nq = self.quantized.size if self.quantized is not None else 0
        self.quantized = _extended(self.quantized, incoming)
        self.full = _filtered(self.full, stay)
        full_pos = {j: n for n, j in enumerate(stay)}
        moved = {i: nq + n for n, i in enumerate(moving)}
        self._set_where(
            [(True, moved[i]) if i in moved else (q, j if q else full_pos[j]) for i, (q, j) in enumerate(self.where)]
        )
        if self.full is None and not self._order().in_order:
            # Every row is quantized now: one copy into batch order spares every later step its gathers.
            assert self.quantized is not None
            self.quantized.filter([j for _, j in self.where])
            self._set_where([(True, i) for i in range(len(self.where))])

    def to_solo(self) -> KVCache | QuantizedKVCache:
        """A one-row batch as a solo cache."""
        assert len(self.where) == 1
        return self.extract(0)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in (self.full, self.quantized) if part is not None)


def _filtered(part: Any, keep: list[int]) -> Any:
    if part is None or not keep:
        return None
    if keep != list(range(part.size)):
        part.filter(keep)
    return part


def _extended(part: Any, other: Any) -> Any:
    if part is None:
        return other
    if other is not None:
        part.extend(other)
    return part


# The caches that run their own attention (`attend`) instead of handing keys and values back.
ATTENDING_CACHES = (*QUANTIZED_CACHES, MixedBatchKVCache)
