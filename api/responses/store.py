"""The Responses store: what `previous_response_id` continues from.

`ResponseStore` is the memory tier, process-local. `Responses` puts it in front of the durable
store when there is one (actors/ssd/response_log.py: `--response-store`, or under
`--ssd-cache`): a put is written there before the route answers, and a read that misses memory
reads the record back from disk (verified) into memory.

Each entry keeps a finished response's effective input items
(continuations included, in OpenAI's item shapes with their ids: what GET
/v1/responses/{id}/input_items lists), its output items, its instructions and the Response
object itself (for GET /v1/responses/{id}). Entries expire `ttl_s` after they were stored; reads touch them
for LRU; the memory they take is capped at `max_bytes`, evicting least recently used entries
first. Expiry is swept on every put and get. Only the trio thread touches it: no lock.

The cap counts what the entries cost in memory, measured (`sys.getsizeof` over each entry's
objects), not their JSON length: a parsed item is dicts, lists and small strings, which take
several times their JSON text (about 4x for a conversation of two-word messages). The measure is
within 5% of what tracemalloc sees (tests/api/test_response_store.py). A continuation's entry holds the
same text strings as the entries before it, so strings of `SHARED_MIN_BYTES` or more are counted
once for the whole store, however many entries hold them; smaller objects are counted per entry.
/stats `responses_store` and /metrics `mlx_trio:responses_store_*` show the count.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import attrs

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 32 * 2**20  # of measured memory
SHARED_MIN_BYTES = 512  # strings this large are counted once per store, not once per entry holding them


@attrs.frozen
class StoredResponse:
    input: list[Any]
    output: list[Any]
    instructions: str | None
    response: dict[str, Any]
    size: int  # its own objects' bytes (the shared strings are the store's)
    shared: tuple[str, ...]  # its strings of SHARED_MIN_BYTES or more, each once
    expires_at: float


def measure(value: Any) -> tuple[int, list[str]]:
    """(bytes of the objects `value` is made of, each counted once, and its strings of
    SHARED_MIN_BYTES or more, which are left out of that count). JSON-shaped values: dicts,
    lists, tuples, strings, numbers, booleans and None."""
    seen: set[int] = set()
    own, large, stack = 0, [], [value]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        size = sys.getsizeof(obj)
        if isinstance(obj, str) and size >= SHARED_MIN_BYTES:
            large.append(obj)
            continue
        own += size
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return own, large


class ResponseStore:
    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._shared: dict[int, tuple[str, int]] = {}  # id -> (the string, entries holding it)
        self.bytes = 0  # measured: every entry's own objects plus each shared string once
        self.evicted = 0  # entries pushed out by the cap (expiry and delete not counted)
        self.refused = 0  # entries over the cap on their own, never kept

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(
        self,
        response_id: str,
        *,
        input: list[Any],
        output: list[Any],
        instructions: str | None,
        response: dict[str, Any],
        ttl_s: float | None = None,
    ) -> bool:
        """Store (or replace) an entry, for `ttl_s` (default: the store's); False when it alone is
        over the byte cap (not kept)."""
        self._sweep()
        self._drop(response_id)
        own, large = measure([input, output, instructions, response])
        if own + sum(sys.getsizeof(text) for text in large) > self.max_bytes:
            self.refused += 1
            return False
        self._entries[response_id] = StoredResponse(
            input=input,
            output=output,
            instructions=instructions,
            response=response,
            size=own,
            shared=tuple(large),
            expires_at=self._clock() + (self.ttl_s if ttl_s is None else ttl_s),
        )
        self.bytes += own
        for text in large:
            self._hold(text)
        while self.bytes > self.max_bytes:  # ends at the latest with the new entry alone, which fits
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        return True

    def stats(self) -> dict[str, Any]:
        """/stats' `responses_store` block."""
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "evicted": self.evicted,
            "refused": self.refused,
            "ttl_s": self.ttl_s,
        }

    def get(self, response_id: str) -> StoredResponse | None:
        self._sweep()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # LRU touch
        return entry

    def delete(self, response_id: str) -> bool:
        self._sweep()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        for text in entry.shared:
            self._release(text)
        return True

    def _hold(self, text: str) -> None:
        held = self._shared.get(id(text))
        if held is None:
            self.bytes += sys.getsizeof(text)
        self._shared[id(text)] = (text, 1 if held is None else held[1] + 1)  # (the reference pins the id)

    def _release(self, text: str) -> None:
        _, holders = self._shared[id(text)]
        if holders > 1:
            self._shared[id(text)] = (text, holders - 1)
        else:
            del self._shared[id(text)]
            self.bytes -= sys.getsizeof(text)

    def _sweep(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, e in self._entries.items() if e.expires_at <= now]:
            self._drop(response_id)


class DurableLog(Protocol):
    """The durable store as the routes use it (actors.ssd.response_log.ResponseLog)."""

    async def put(self, record: dict[str, Any]) -> bool: ...

    async def get(self, rid: str) -> dict[str, Any] | None: ...

    async def delete(self, rid: str) -> bool: ...

    def record(self, rid: str, **fields: Any) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


class Responses:
    """The memory store in front of the durable one (None: memory alone)."""

    def __init__(
        self, memory: ResponseStore, durable: DurableLog | None = None, *, wall: Callable[[], float] = time.time
    ) -> None:
        self.memory = memory
        self.durable = durable
        self._wall = wall

    async def put(
        self,
        response_id: str,
        *,
        input: list[Any],
        output: list[Any],
        instructions: str | None,
        response: dict[str, Any],
    ) -> bool:
        """Keep an entry; with a durable store, returns once it is on disk (False: it could not be
        written and lives in memory only)."""
        fields: dict[str, Any] = {"input": input, "output": output, "instructions": instructions, "response": response}
        self.memory.put(response_id, **fields)
        if self.durable is None:
            return True
        return await self.durable.put(self.durable.record(response_id, **fields))

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self.memory.get(response_id)
        if entry is not None or self.durable is None:
            return entry
        record = await self.durable.get(response_id)
        if record is None:
            return None
        fields: dict[str, Any] = {k: record[k] for k in ("input", "output", "instructions", "response")}
        ttl_s = max(0.0, float(record["expires_at"]) - self._wall())
        if self.memory.put(response_id, **fields, ttl_s=ttl_s):
            entry = self.memory.get(response_id)
        # Too large for memory: served from this read alone.
        return entry or StoredResponse(**fields, size=0, shared=(), expires_at=0.0)

    async def delete(self, response_id: str) -> bool:
        in_memory = self.memory.delete(response_id)
        on_disk = await self.durable.delete(response_id) if self.durable is not None else False
        return in_memory or on_disk

    def stats(self) -> dict[str, Any]:
        """/stats' `responses_store` block (the durable store's under `durable`)."""
        stats = self.memory.stats()
        return stats if self.durable is None else {**stats, "durable": self.durable.stats()}
