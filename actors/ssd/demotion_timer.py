"""Demotion-timer actor: RAM entries unused for `--ssd-demote-idle` seconds move to the SSD tier.

Inbound:  none — it runs on its own fixed cadence, `interval = max(30 s, idle_s / 4)`.
Outbound: `demote_idle(idle_s)` jobs on the GPU worker (frees the idle entries and hands back
          SpillItems of those the SSD lacks), then one fire-and-forget `Spill` per item to the
          spill queue.

A tick is skipped while any row is running or queued (`busy()`): a maintenance job must never
hold batch admission, and a busy engine is using its entries anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from actors.ssd.spill_queue import SpillQueue
from cache.spill_item import SpillItem

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 30.0


class DemotionPort(Protocol):
    """The GPU worker as demotion sees it: frees idle RAM entries, returns those the SSD lacks."""

    async def demote_idle(self, idle_s: float) -> list[SpillItem]: ...


@attrs.define
class DemotionCounters:
    ticks: int = 0
    skipped_busy: int = 0
    runs: int = 0
    spilled: int = 0  # items handed to the spill queue


def demotion_interval(idle_s: float) -> float:
    return max(MIN_INTERVAL_S, idle_s / 4)


class DemotionTimer:
    def __init__(
        self,
        port: DemotionPort,
        spills: SpillQueue,
        *,
        busy: Callable[[], bool],
        idle_s: float,
        interval_s: float | None = None,
    ) -> None:
        self._port = port
        self._spills = spills
        self._busy = busy
        self.idle_s = idle_s
        self.interval_s = interval_s if interval_s is not None else demotion_interval(idle_s)
        self.counters = DemotionCounters()
        self._scope = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.idle_s <= 0:
            return
        with self._scope:
            next_at = trio.current_time() + self.interval_s
            while True:
                await trio.sleep_until(next_at)
                next_at = max(next_at + self.interval_s, trio.current_time())
                self.counters.ticks += 1
                if self._busy():
                    self.counters.skipped_busy += 1
                    continue
                try:
                    items = await self._port.demote_idle(self.idle_s)
                except Exception:  # noqa: BLE001 - a failed sweep is retried next tick
                    log.exception("idle demotion failed")
                    continue
                self.counters.runs += 1
                for item in items:
                    self._spills.submit_nowait(item)
                self.counters.spilled += len(items)
                if items:
                    log.info(
                        "demoted %d idle prompt-cache entr%s to the SSD tier",
                        len(items),
                        "y" if len(items) == 1 else "ies",
                    )

    def stop(self) -> None:
        """Stop ticking (shutdown: before the final flush)."""
        self._scope.cancel()
