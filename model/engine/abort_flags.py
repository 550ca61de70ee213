"""The rows whose prefill should stop: set on the trio thread, read on the MLX thread.

No MLX here: the GPU worker creates the flags on the trio side (model/engine/prefill_abort.py reads
them between a prefill's layers), and nothing on that side may import MLX before the BLAS
preload (model/load/blas.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class AbortFlags:
    """Row ids whose abort was asked for; every method is safe from any thread."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def add(self, row_id: int) -> None:
        with self._lock:
            self._ids.add(row_id)

    def discard(self, row_id: int) -> None:
        with self._lock:
            self._ids.discard(row_id)

    def __contains__(self, row_id: object) -> bool:
        with self._lock:
            return row_id in self._ids

    def all_of(self, row_ids: Iterable[int]) -> bool:
        with self._lock:
            return all(r in self._ids for r in row_ids)
