"""The SSD tier's in-memory index: one entry per file, byte-capped, LRU by file mtime.

An entry written at a client's retention hint (`retain_until`, wall-clock) is evicted only after
every unhinted one, until its deadline, and within `retention_share` of the cap (over it, the
hinted entries whose deadlines come first lose protection first), as the RAM tier keeps it.

Used from the GPU-worker thread (lookups) and from the writer thread (commits), so every access
holds one lock. It only keeps the books: the store unlinks the files of what it drops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cache.prefix_match import common_prefix_length
from model.options import CacheOptions
from model.options.flags import default_of

RETENTION_SHARE: float = default_of(CacheOptions, "cache_retention_share")


@attrs.define(eq=False)
class IndexEntry:
    path: Path
    namespace: str
    ids: np.ndarray  # int64 tokens
    nbytes: int  # file size
    mtime: float
    trimmable: bool
    retain_until: float | None = None  # written at a retention hint: protected until then (epoch s)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@attrs.frozen
class Dropped:
    """Entries a change pushed out of the index; their files are for the caller to remove."""

    superseded: list[IndexEntry] = attrs.Factory(list)  # same key, or an ancestor of a trimmable entry
    evicted: list[IndexEntry] = attrs.Factory(list)  # over the byte cap, oldest first

    @property
    def all(self) -> list[IndexEntry]:
        return [*self.superseded, *self.evicted]


class SsdIndex:
    def __init__(self, *, retention_share: float = RETENTION_SHARE, clock: Callable[[], float] = time.time) -> None:
        self.retention_share = min(1.0, max(0.0, retention_share))
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Path, IndexEntry] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def longest(self) -> int:
        with self._lock:
            return max((e.length for e in self._entries.values()), default=0)

    def entries(self) -> list[IndexEntry]:
        with self._lock:
            return list(self._entries.values())

    # -- lookups ---------------------------------------------------------------------------------

    def find(self, prompt: np.ndarray, namespace: str, cap: int) -> tuple[IndexEntry, int] | None:
        """The entry giving the longest usable prefix of `prompt` (at most `cap` tokens), and
        that length. Entries that would need a trim they cannot do are never candidates."""
        best: tuple[IndexEntry, int] | None = None
        best_key = (0, 0, 0.0)
        with self._lock:
            candidates = [e for e in self._entries.values() if e.namespace == namespace]
        for entry in candidates:
            usable = min(common_prefix_length(entry.ids, prompt), cap)
            if usable == 0:
                continue
            exact_fit = entry.length == usable
            if not exact_fit and not entry.trimmable:
                continue
            key = (usable, int(exact_fit), entry.mtime)
            if key > best_key:
                best, best_key = (entry, usable), key
        return best

    def has_exact(self, tokens: Sequence[int], namespace: str) -> bool:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        with self._lock:
            return any(
                e.namespace == namespace and e.length == ids.shape[0] and np.array_equal(e.ids, ids)
                for e in self._entries.values()
            )

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """An exact entry, or a longer trimmable one that starts with `tokens`, is indexed."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            return False
        with self._lock:
            return any(covers(e, ids, namespace) for e in self._entries.values())

    # -- changes ---------------------------------------------------------------------------------

    def load(self, entries: Iterable[IndexEntry], max_bytes: int) -> Dropped:
        """Index the entries a start-up scan found, then evict down to `max_bytes`."""
        with self._lock:
            for entry in entries:
                self._entries[entry.path] = entry
                self._bytes += entry.nbytes
            return Dropped(evicted=self._evict_locked(max_bytes, keep=None))

    def add(self, entry: IndexEntry, max_bytes: int) -> Dropped:
        """Index a newly written entry: it replaces an entry of the same key and, when trimmable,
        every strict prefix of itself in its namespace (it serves them all); then evict down to
        `max_bytes`, never the new entry."""
        with self._lock:
            superseded: list[IndexEntry] = []
            n = entry.length
            for other in list(self._entries.values()):
                if other.namespace != entry.namespace:
                    continue
                same = other.length == n and np.array_equal(other.ids, entry.ids)
                ancestor = entry.trimmable and other.length < n and np.array_equal(entry.ids[: other.length], other.ids)
                if same or ancestor:
                    superseded.append(other)
            for v in superseded:
                self._entries.pop(v.path, None)
                self._bytes -= v.nbytes
            self._entries[entry.path] = entry
            self._bytes += entry.nbytes
            return Dropped(superseded=superseded, evicted=self._evict_locked(max_bytes, keep=entry.path))

    def remove(self, entry: IndexEntry) -> None:
        with self._lock:
            if self._entries.pop(entry.path, None) is not None:
                self._bytes -= entry.nbytes

    def _evict_locked(self, max_bytes: int, keep: Path | None) -> list[IndexEntry]:
        victims = []
        held = self._held_locked(max_bytes) if self._bytes > max_bytes else set()
        while self._bytes > max_bytes:
            candidates = [e for e in self._entries.values() if e.path != keep]
            if not candidates:
                break
            free = [e for e in candidates if e.path not in held]
            if free:
                victim = min(free, key=lambda e: e.mtime)
            else:  # only protected entries left: the deadline that comes first goes first
                victim = min(candidates, key=lambda e: e.retain_until or 0.0)
            self._entries.pop(victim.path)
            self._bytes -= victim.nbytes
            victims.append(victim)
        return victims

    def _held_locked(self, max_bytes: int) -> set[Path]:
        """The entries still protected by their retention deadline, latest deadlines first, within
        the share of the cap."""
        now, room = self._clock(), self.retention_share * max_bytes
        hinted = [e for e in self._entries.values() if e.retain_until is not None and e.retain_until > now]
        held: set[Path] = set()
        for entry in sorted(hinted, key=lambda e: -(e.retain_until or 0.0)):
            if entry.nbytes > room:
                break
            room -= entry.nbytes
            held.add(entry.path)
        return held


def covers(entry: IndexEntry, ids: np.ndarray, namespace: str) -> bool:
    """`entry` serves the prompt `ids` (int64, non-empty): it is that exact entry, or a longer
    trimmable one that starts with it."""
    n = ids.shape[0]
    if entry.namespace != namespace or entry.length < n or (entry.length > n and not entry.trimmable):
        return False
    return bool(entry.ids[n - 1] == ids[n - 1] and np.array_equal(entry.ids[:n], ids))
