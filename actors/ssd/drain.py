"""A model's whole RAM prompt cache, demoted to the SSD tier: the step before it leaves the pool.

The SSD tier keeps each model identity's entries in a directory of its own (cache/ssd_identity.py),
so what a model leaves behind there is found again when the same weights load later: a prompt
served before the eviction is served from disk afterwards (`cached_tokens`), not prefilled again.
Durability writes every put behind the fact; this drain makes it complete and immediate: every
job already asked of the worker runs, every RAM entry leaves RAM (`GpuWorker.demote_all`) and the
ones the SSD lacks are written one at a time (the spill queue's cap never drops one), then the
durability flush settles whatever was still dirty. `POST /admin/drain` runs it by hand
(api/pool_routes.py); the pool before every unload (actors/pool.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import trio

from actors.ssd.durability import SsdTier
from actors.ssd.view import SsdView
from cache.spill_item import SpillItem

log = logging.getLogger(__name__)


@runtime_checkable
class DemotesAll(Protocol):
    async def demote_all(self) -> list[SpillItem]: ...


@attrs.frozen
class DrainReport:
    """What one drain did (`POST /admin/drain` answers it, camelCase)."""

    demoted: int = 0  # entries that left RAM
    written: int = 0  # of them, written to the SSD now (the rest were on disk already)
    failed: int = 0  # written but refused, dropped or failed: lost with the RAM
    durable: bool = True  # the durability flush after it found nothing lost
    ssd_entries: int = 0
    elapsed_ms: float = 0.0


@runtime_checkable
class DrainsItself(Protocol):
    """A tier in another process (an isolated engine's: actors/isolate/remote.py) drains there."""

    async def drain(self) -> DrainReport: ...


async def drain_to_ssd(tier: SsdView | None, worker: object) -> DrainReport:
    """Demote everything the worker's RAM tier holds to `tier`; a report of zeros without one."""
    if isinstance(tier, DrainsItself):
        return await tier.drain()
    if not isinstance(tier, SsdTier) or not isinstance(worker, DemotesAll):
        return DrainReport()
    started = trio.current_time()
    await tier.quiesce()  # (a finished row's close_row put is in RAM before the demotion)
    before = tier.cache.demotions
    items: Sequence[SpillItem] = await worker.demote_all()
    written = failed = 0
    with tier.spills.forcing():
        for item in items:
            if await tier.spills.submit(item):
                written += 1
            else:
                failed += 1
    flushed = await tier.durability.flush()
    report = DrainReport(
        demoted=tier.cache.demotions - before,
        written=written,
        failed=failed,
        durable=flushed.durable and not failed,
        ssd_entries=len(tier.store),
        elapsed_ms=round((trio.current_time() - started) * 1000, 3),
    )
    log.info(
        "drained the prompt cache to the SSD tier: %d entr%s written, %d failed, %d on disk (%.0f ms)",
        written,
        "y" if written == 1 else "ies",
        failed,
        report.ssd_entries,
        report.elapsed_ms,
    )
    return report
