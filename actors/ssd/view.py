"""The SSD tier as the root, the flush route and a model pool reach it: the tier's actors in this
process (actors/ssd/durability.py `SsdTier`), or in an isolated engine's process
(actors/isolate/remote.py `RemoteSsdTier`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from actors.messages import FlushResult


class SsdView(Protocol):
    async def flush(self) -> FlushResult:
        """Make every dirty prompt-cache entry durable now (POST /admin/cache/flush)."""
        ...

    async def shutdown_flush(self, *, timeout: float) -> FlushResult:
        """Stop the timers, then flush within `timeout` (logged either way)."""
        ...

    def stats(self) -> dict[str, Any]:
        """/stats' `ssd_cache` block (`entries` and `longest_durable_prefix_tokens` among it)."""
        ...


@runtime_checkable
class KeepsSsdTier(Protocol):
    """A worker whose SSD tier runs beside its engine in another process (actors/isolate/): the
    root takes that tier instead of starting the tier's actors here."""

    ssd_tier: SsdView | None
