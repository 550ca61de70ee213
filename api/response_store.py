"""The Responses store: what `previous_response_id` continues from.

Process-local and in memory. Each entry keeps a finished response's effective input items
(continuations included, in OpenAI's item shapes with their ids: what GET
/v1/responses/{id}/input_items lists), its output items, its instructions and the Response
object itself (for GET /v1/responses/{id}). Entries expire `ttl_s` after they were stored; reads touch them
for LRU; the total JSON size is capped at `max_bytes`, evicting least recently used entries
first. Expiry is swept on every put and get. Only the trio thread touches it: no lock.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 32 * 2**20


@attrs.frozen
class StoredResponse:
    input: list[Any]
    output: list[Any]
    instructions: str | None
    response: dict[str, Any]
    size: int
    expires_at: float


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
        self.bytes = 0

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
    ) -> bool:
        """Store (or replace) an entry; False when it alone is over the byte cap (not kept)."""
        self._sweep()
        self._drop(response_id)
        size = len(json.dumps([input, output, instructions, response], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        self._entries[response_id] = StoredResponse(
            input=input,
            output=output,
            instructions=instructions,
            response=response,
            size=size,
            expires_at=self._clock() + self.ttl_s,
        )
        self.bytes += size
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
        return True

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
        return True

    def _sweep(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, e in self._entries.items() if e.expires_at <= now]:
            self._drop(response_id)
