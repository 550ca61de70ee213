"""RAM prompt cache: per-layer KV keyed by (namespace, exact token tuple), byte-capped LRU.

`take` is non-consuming: it hands out clones (trimmed back to the match when the donor is
longer), so one stored system prompt serves every agent that shares it. MLX arrays are immutable
values, so a clone stays valid after its donor is superseded or evicted: eviction only drops the
cache's reference, it never frees memory a clone still uses.

Retention (a client's prompt-cache breakpoint, api/chat.py): an entry put with `retain_s` is
protected from LRU eviction until its deadline, within `retention_share` of the byte cap (over
it, the protected entries whose deadlines come first lose protection first). A hit on a prefix
holding it refreshes the deadline; after the deadline it is an ordinary LRU entry.

Correctness rule: an entry's key must equal its KV coverage exactly, or every later hit would be
silently wrong. `put` refuses anything it cannot verify (offset mismatch, mixed offsets).

Only ever called on the GPU-worker thread (arrays are thread-affine).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from cache.prefix_match import common_prefix_length
from model.kv.cache import KVCache
from model.options import CacheOptions
from model.options.flags import default_of

# The share of the cache breakpoint entries may hold protected (--cache-retention-share's default).
RETENTION_SHARE: float = default_of(CacheOptions, "cache_retention_share")

log = logging.getLogger(__name__)

PutHook = Callable[[str, tuple[int, ...]], None]


class EntryKey:
    """(namespace, tokens) with its hash computed once: tuple hashes are not cached, and the
    C OrderedDict re-hashes keys while iterating, which for 100k-token keys dominated a take."""

    __slots__ = ("namespace", "tokens", "_hash")

    def __init__(self, namespace: str, tokens: tuple[int, ...]) -> None:
        self.namespace, self.tokens = namespace, tokens
        self._hash = hash((namespace, tokens))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, EntryKey)
            and self._hash == other._hash
            and self.namespace == other.namespace
            and self.tokens == other.tokens
        )


@attrs.define(eq=False)
class _Entry:
    key: EntryKey
    ids: np.ndarray
    caches: list[KVCache]
    nbytes: int
    trimmable: bool
    retain_s: float | None = None  # put with a retention hint: protected for this long after a put or hit
    deadline: float | None = None  # protected until then (None: an ordinary LRU entry)


def _coverage(caches: Sequence[KVCache]) -> int | None:
    """The token count every layer holds, or None when layers disagree (then nothing is safe)."""
    offsets = {c.offset for c in caches}
    return offsets.pop() if len(offsets) == 1 else None


class PromptCache:
    def __init__(
        self, max_bytes: int, *, retention_share: float = RETENTION_SHARE, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max(0, int(max_bytes))
        # What running rows leave it (`yield_to`): it holds at most the smaller of the two.
        self.room: int | None = None
        self.retention_share = min(1.0, max(0.0, retention_share))
        self._now = now
        self._entries: OrderedDict[EntryKey, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.on_put: list[PutHook] = []

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def capacity(self) -> int:
        """The bytes it may hold now: its size, less what running rows took (`yield_to`)."""
        return self.max_bytes if self.room is None else max(0, min(self.max_bytes, self.room))

    def yield_to(self, room: int) -> int:
        """Running rows and this cache share one budget: it keeps at most `room` bytes, evicting
        least recently used entries first (protected ones last). Returns the bytes evicted."""
        self.room = room
        before, now = self._bytes, self._now()
        while self._bytes > self.capacity and self._entries:
            self._remove(self._victim(now))
        return before - self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """(namespace, tokens) of every entry, least recently used first."""
        return [(k.namespace, k.tokens) for k in self._entries]

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "capacity_bytes": self.capacity,  # (less, while running rows took room from it)
            "hits": self.hits,
            "misses": self.misses,
        }

    # -- take --------------------------------------------------------------------------------

    def take(self, prompt: Sequence[int], namespace: str = "", min_tokens: int = 1) -> tuple[list[KVCache] | None, int]:
        """Clones covering the longest usable prefix of `prompt`, and its length; (None, 0) on a
        miss. At most len(prompt) - 1 tokens are restored: the last one must be forwarded to get
        logits. A prefix shorter than `min_tokens` counts as a miss."""
        cap = len(prompt) - 1
        found = self._best(np.asarray(prompt, dtype=np.int64), namespace, cap) if self.enabled and cap > 0 else None
        if found is None or found[1] < min_tokens:
            self.misses += 1
            return None, 0
        entry, usable = found
        clones = [c.clone() for c in entry.caches]
        excess = len(entry.ids) - usable
        if excess and any(c.trim(excess) != excess for c in clones):
            self.misses += 1  # cannot happen for a trimmable entry; a miss is the safe answer
            return None, 0
        self._entries.move_to_end(entry.key)
        self.hits += 1
        self._refresh(entry.ids[:usable], namespace)
        return clones, usable

    def _best(self, prompt: np.ndarray, namespace: str, cap: int) -> tuple[_Entry, int] | None:
        best: tuple[_Entry, int] | None = None
        best_key = (0, 0, -1)  # (usable, needs no trim, recency)
        for recency, entry in enumerate(self._entries.values()):
            if entry.key.namespace != namespace:
                continue
            usable = min(common_prefix_length(entry.ids, prompt), cap)
            if usable == 0:
                continue
            exact_fit = len(entry.ids) == usable
            if not exact_fit and not entry.trimmable:
                continue  # would need a trim this entry cannot do: never a candidate
            key = (usable, int(exact_fit), recency)
            if key > best_key:
                best, best_key = (entry, usable), key
        return best

    def find_exact(self, tokens: Sequence[int], namespace: str = "") -> list[KVCache] | None:
        """Read-only clones of the entry keyed exactly `tokens` (for durability snapshots); does
        not count as a hit or touch the LRU order."""
        entry = self._entries.get(EntryKey(namespace, tuple(int(t) for t in tokens)))
        return None if entry is None else [c.clone() for c in entry.caches]

    # -- put ---------------------------------------------------------------------------------

    def put(
        self, tokens: Sequence[int], caches: Sequence[KVCache], namespace: str = "", retain_s: float | None = None
    ) -> bool:
        """Store `caches` (taken over, not copied) as the KV of exactly `tokens`, protected from
        eviction for `retain_s` seconds when given. False when not stored: cache disabled, empty
        key, coverage that does not match the key, too big, or evicted at once (every other entry
        protected)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        key_tokens = tuple(ids.tolist())
        if not self.enabled or not key_tokens or not caches:
            return False
        if _coverage(caches) != len(key_tokens):
            log.warning(
                "prompt cache: refused a put whose KV covers %s tokens but whose key has %d",
                _coverage(caches),
                len(key_tokens),
            )
            return False
        entry = _Entry(
            key=EntryKey(namespace, key_tokens),
            ids=ids,
            caches=list(caches),
            nbytes=sum(c.nbytes for c in caches),
            trimmable=all(c.is_trimmable() for c in caches),
        )
        if entry.nbytes > self.capacity:
            return False
        now = self._now()
        replaced = self._entries.get(entry.key)
        if retain_s is not None:
            entry.retain_s, entry.deadline = retain_s, now + retain_s
        if replaced is not None and replaced.retain_s is not None:  # a re-put keeps the longer promise
            entry.retain_s = max(replaced.retain_s, entry.retain_s or 0.0)
            entry.deadline = max(replaced.deadline or 0.0, entry.deadline or 0.0) or None
        self._remove(entry.key)
        if entry.trimmable:
            # A trimmable entry serves every strict prefix of itself, so its ancestors only cost RAM
            # (a protected one stays: it must outlive its descendants' LRU fate).
            for other in [e for e in self._entries.values() if e.key.namespace == namespace and not self._held(e, now)]:
                n = len(other.ids)
                # The last-token check first: siblings sharing 99% of a long prompt are common.
                if n < len(ids) and ids[n - 1] == other.ids[-1] and np.array_equal(ids[:n], other.ids):
                    self._remove(other.key)
        self._entries[entry.key] = entry
        self._bytes += entry.nbytes
        self._cap_protection(now)
        while self._bytes > self.capacity:
            self._remove(self._victim(now))
        if entry.key not in self._entries:
            return False
        for hook in self.on_put:
            try:
                hook(namespace, key_tokens)
            except Exception:
                # The durability tier must never take serving down; a missed hook is a future miss.
                log.exception("prompt cache on_put hook failed")
        return True

    # -- retention -----------------------------------------------------------------------------

    @staticmethod
    def _held(entry: _Entry, now: float) -> bool:
        return entry.deadline is not None and entry.deadline > now

    def protected_bytes(self) -> int:
        now = self._now()
        return sum(e.nbytes for e in self._entries.values() if self._held(e, now))

    def _victim(self, now: float) -> EntryKey:
        """The least recently used unprotected entry; with none, the protected one whose deadline
        comes first (only when the share is 1: otherwise unprotected bytes exceed the rest)."""
        for key, entry in self._entries.items():
            if not self._held(entry, now):
                return key
        return min(self._entries.values(), key=lambda e: e.deadline or 0.0).key

    def _cap_protection(self, now: float) -> None:
        """Over the share, the protected entries whose deadlines come first become ordinary."""
        held = sorted((e for e in self._entries.values() if self._held(e, now)), key=lambda e: e.deadline or 0.0)
        excess = sum(e.nbytes for e in held) - self.retention_share * self.capacity
        for entry in held:
            if excess <= 0:
                break
            entry.deadline = None
            excess -= entry.nbytes

    def _refresh(self, restored: np.ndarray, namespace: str) -> None:
        """A hit uses every retained entry that is a prefix of what it restored: each one's
        deadline starts again (Anthropic refreshes a cache entry's TTL on use)."""
        now, refreshed = self._now(), False
        for entry in self._entries.values():
            n = len(entry.ids)
            if (
                entry.retain_s is not None
                and entry.key.namespace == namespace
                and n <= len(restored)
                and np.array_equal(entry.ids, restored[:n])
            ):
                entry.deadline, refreshed = now + entry.retain_s, True
        if refreshed:
            self._cap_protection(now)

    def _remove(self, key: EntryKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
