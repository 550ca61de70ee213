"""What the server reads and asks of an isolated engine's caches, in the shapes it reads them in
one process: the prompt cache's and the MLX thread's /stats blocks, and the SSD tier.

/stats reads its blocks without awaiting, so the worker keeps the engine's last answer to
`stats` (asked every `STATS_S`, and after every SSD call) and these views show it. The SSD tier's
actors run in the engine process (actors/isolate/host.py): a flush, the shutdown flush and a
model pool's drain are calls there, and what they return is what the tier in one process returns.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from actors.messages import FlushResult
from actors.ssd.drain import DrainReport

log = logging.getLogger(__name__)

STATS_S = 1.0  # how often the worker asks the engine for its /stats blocks


class EngineStats(Protocol):
    """The isolated worker as these views reach it (actors/isolate/worker.py)."""

    def stats_block(self, name: str) -> dict[str, Any] | None:
        """The engine's last `stats` answer's block `name` (None: none yet, or it has none)."""
        ...

    def keep_stats(self, name: str, block: dict[str, Any]) -> None: ...

    async def host_call(self, method: str, **kwargs: Any) -> Any:
        """A call of the engine process's own (protocol.HOST_CALLS), once an engine serves."""
        ...


class RemoteTimes:
    """`WorkerTimes.snapshot()` of the engine's MLX thread."""

    def __init__(self, engine: EngineStats) -> None:
        self._engine = engine

    def snapshot(self) -> dict[str, Any]:
        block = self._engine.stats_block("times")
        return dict(block) if block is not None else {"jobs": {}, "busy_s": {}, "idle_s": 0.0}


class RemoteCacheStats:
    """The engine's prompt cache as /stats reads it."""

    def __init__(self, engine: EngineStats) -> None:
        self._engine = engine

    def stats(self) -> dict[str, Any]:
        block = self._engine.stats_block("prompt_cache")
        return dict(block) if block is not None else {"entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}


class RemoteSsdTier:
    """The engine's SSD tier (actors/ssd/durability.py `SsdView`)."""

    def __init__(self, engine: EngineStats) -> None:
        self._engine = engine

    def stats(self) -> dict[str, Any]:
        return dict(self._engine.stats_block("ssd") or {})

    async def flush(self) -> FlushResult:
        try:
            answer = await self._engine.host_call("ssd_flush")
        except Exception as exc:  # noqa: BLE001 - the engine is gone or failed: nothing was made durable
            log.warning("SSD flush: the model's engine cannot answer (%s)", exc)
            return FlushResult(durable=False)
        self._engine.keep_stats("ssd", answer["stats"])
        result: FlushResult = answer["result"]
        return result

    async def shutdown_flush(self, *, timeout: float) -> FlushResult:
        """The engine's shutdown flush (it logs what it made durable); not durable when the engine
        cannot answer within `timeout` (and a moment for the answer to come back)."""
        with trio.move_on_after(timeout + 2.0):
            try:
                answer = await self._engine.host_call("ssd_shutdown_flush", timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - see flush
                log.warning("shutdown flush: the model's engine cannot answer (%s): NOT durable", exc)
                return FlushResult(durable=False)
            self._engine.keep_stats("ssd", answer["stats"])
            result: FlushResult = answer["result"]
            return result
        log.warning("shutdown flush: the model's engine did not answer within %.0f s: NOT durable", timeout)
        return FlushResult(durable=False)

    async def drain(self) -> DrainReport:
        """The RAM prompt cache, demoted to the SSD tier (actors/ssd/drain.py), in the engine."""
        answer = await self._engine.host_call("ssd_drain")
        self._engine.keep_stats("ssd", answer["stats"])
        report: DrainReport = answer["report"]
        return report
