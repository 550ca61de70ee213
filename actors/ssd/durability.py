"""Durability actor: write-behind of every RAM prompt-cache put to the SSD tier.

Inbound:  `inbox` — `MarkDirty(namespace, tokens)` from the GPU worker's PromptCache.put hook
          (unbounded; the worker thread posts with `send_nowait` through the trio token).
Outbound: `snapshot` jobs on the GPU worker (a zero-copy `SpillItem` of the exact entry, taken
          between steps), `Spill` messages to the spill queue, awaiting each one's `SpillDone`.
Calls:    `flush()` — single-flight — from POST /admin/cache/flush and from shutdown.

Every put marks a dirty record keyed by namespace + exact token list (so a fast final put never
cancels a pending boundary snapshot, and equal-length unrelated prompts never cancel each other).
A record fires `debounce_s` after its last mark; while the engine is busy it re-arms
`busy_rearm_s` later instead (a background snapshot must not hold batch admission). It stays
dirty until the store confirms the write; a drop or failure re-arms it, so a flush can retry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import attrs
import trio

from actors.messages import FlushResult, MarkDirty
from actors.ssd.demotion_timer import DemotionPort, DemotionTimer
from actors.ssd.spill_queue import SpillQueue
from actors.ssd.view import SsdView
from cache.spill_item import SpillItem
from cache.ssd_store import SsdStore

log = logging.getLogger(__name__)

DEBOUNCE_S = 1.0
BUSY_REARM_S = 5.0
RETRY_S = 5.0
MAX_RETRY_S = 60.0
MAX_FLUSH_PASSES = 8

Key = tuple[str, tuple[int, ...]]


class DurabilityPort(Protocol):
    """What durability needs from the GPU worker and the store."""

    async def snapshot(self, tokens: Sequence[int], namespace: str) -> SpillItem | None: ...

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool: ...


class TierCounters(Protocol):
    """The tiered prompt cache's counters /stats reports (plain ints written on the worker thread)."""

    @property
    def restores(self) -> int: ...

    @property
    def restore_ms_last(self) -> float: ...

    @property
    def demotions(self) -> int: ...


class SsdWorker(DurabilityPort, DemotionPort, Protocol):
    """A GPU worker that opened an SSD store (actors.gpu_worker.GpuWorker with --ssd-cache)."""

    @property
    def ssd_store(self) -> SsdStore | None: ...

    @property
    def prompt_cache(self) -> TierCounters: ...

    async def run_exclusive(self, fn: Callable[[Any], Any]) -> Any: ...

    def set_put_listener(self, listener: Callable[[str, tuple[int, ...]], None] | None) -> None: ...


@attrs.define
class DurabilityCounters:
    stored: int = 0  # records confirmed on disk (written, or already covered)
    missing: int = 0  # the entry left RAM before it could be written, and the SSD lacks it
    evicted: int = 0  # the entry left RAM and the SSD size cap had evicted its file: not a loss
    failed_attempts: int = 0  # attempts whose spill was dropped or failed (the record re-armed)
    busy_rearms: int = 0


@attrs.define(eq=False)
class _Record:
    due: float
    gen: int = 0  # bumped by every re-mark: an attempt that started earlier does not clear it
    attempts: int = 0
    running: bool = False


class Durability:
    def __init__(
        self,
        port: DurabilityPort,
        spills: SpillQueue,
        *,
        busy: Callable[[], bool],
        debounce_s: float = DEBOUNCE_S,
        busy_rearm_s: float = BUSY_REARM_S,
        retry_s: float = RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        evicted_by_cap: Callable[[Sequence[int], str], bool] | None = None,
    ) -> None:
        self._port = port
        # The store's memory of its cap evictions (SsdStore.evicted_by_cap); None: it has none.
        self._evicted_by_cap = evicted_by_cap or (lambda tokens, namespace: False)
        self._spills = spills
        self._busy = busy
        self.debounce_s, self.busy_rearm_s = debounce_s, busy_rearm_s
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self.inbox, self._inbox_recv = trio.open_memory_channel[MarkDirty](math.inf)
        self.records: dict[Key, _Record] = {}
        self.counters = DurabilityCounters()
        self._changed = trio.Event()
        self._flushing = False
        self._running_attempts = 0
        self._own_losses = 0  # our submits that came back False (the record is retried)
        self._flight: trio.Event | None = None
        self._flight_result: FlushResult | None = None
        self._nursery: trio.Nursery | None = None

    # -- inbound ---------------------------------------------------------------------------------

    def listener(self, namespace: str, tokens: tuple[int, ...]) -> None:
        """The put hook's trio-side end (runs on the trio thread)."""
        try:
            self.inbox.send_nowait(MarkDirty(namespace, tuple(tokens)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # shutting down: the put is a future miss

    def mark(self, namespace: str, tokens: Sequence[int]) -> None:
        key = (namespace, tuple(int(t) for t in tokens))
        if not key[1]:
            return
        due = trio.current_time() + self.debounce_s
        record = self.records.get(key)
        if record is None:
            self.records[key] = _Record(due=due)
        else:
            record.due = due
            record.gen += 1
        self._poke()

    @property
    def pending_snapshots(self) -> int:
        return len(self.records)

    # -- the actor -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._receive)
            task_status.started()
            await self._timer()

    async def _receive(self) -> None:
        async for message in self._inbox_recv:
            self.mark(message.namespace, message.tokens)

    async def _timer(self) -> None:
        while True:
            changed = self._changed
            if self._flushing:
                await changed.wait()
                continue
            now = trio.current_time()
            next_due = min((r.due for r in self.records.values() if not r.running), default=math.inf)
            if next_due > now:
                with trio.move_on_at(next_due):
                    await changed.wait()
                continue
            for key, record in list(self.records.items()):
                if record.running or record.due > now:
                    continue
                if self._busy():
                    # Taking a snapshot now would hold batch admission: try again later.
                    record.due = now + self.busy_rearm_s
                    self.counters.busy_rearms += 1
                    continue
                record.running = True
                self._running_attempts += 1
                assert self._nursery is not None
                self._nursery.start_soon(self._attempt, key, record)
            await trio.lowlevel.checkpoint()

    async def _attempt(self, key: Key, record: _Record) -> None:
        gen = record.gen
        try:
            outcome = await self._store(key)
        except Exception:  # noqa: BLE001 - the cache tier never takes serving down
            log.exception("durability attempt failed")
            outcome = "failed"
        finally:
            record.running = False
            self._running_attempts -= 1
            self._poke()
        self._settle(key, record, gen, outcome)

    async def _store(self, key: Key) -> str:
        """ "stored" | "evicted" | "missing" | "failed" | "deferred"."""
        namespace, tokens = key
        if self._port.has_durable_prefix(tokens, namespace):
            return "stored"
        item = await self._port.snapshot(tokens, namespace)
        if item is None:  # the entry left RAM: superseded, evicted or demoted
            queued = await self._spills.wait_for(namespace, tokens)
            if queued is not None:
                return "stored" if queued else "failed"
            if self._port.has_durable_prefix(tokens, namespace):
                return "stored"
            if self._dirty_descendant(key):
                return "deferred"  # a longer dirty entry supersedes it: it will cover this one
            if self._evicted_by_cap(tokens, namespace):
                # It (or a trimmable descendant serving it) reached the SSD, then --ssd-cache-max
                # pushed it out: the tier kept what its cap allows, nothing was lost.
                return "evicted"
            return "missing"
        done = await self._spills.submit_outcome(item)
        if done.stored:
            return "stored"
        self._own_losses += 1
        if done.reason == "refused":
            # The store will never take it (bigger than --ssd-cache-max, or an unsupported kind).
            log.warning("durability: the SSD tier refused a %d-token entry; it stays RAM-only", len(tokens))
            return "missing"
        return "failed"

    def _take_inbox(self) -> None:
        while True:
            try:
                message = self._inbox_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            self.mark(message.namespace, message.tokens)

    def _dirty_descendant(self, key: Key) -> bool:
        namespace, tokens = key
        n = len(tokens)
        return any(ns == namespace and len(other) > n and other[:n] == tokens for (ns, other) in self.records)

    def _settle(self, key: Key, record: _Record, gen: int, outcome: str) -> None:
        if self.records.get(key) is not record:
            return
        if outcome in ("stored", "evicted", "missing"):
            if outcome == "stored":
                self.counters.stored += 1
            elif outcome == "evicted":
                self.counters.evicted += 1
            else:
                self.counters.missing += 1
                log.info("durability: a %d-token entry left RAM before reaching the SSD", len(key[1]))
            if record.gen == gen:
                del self.records[key]
            return
        if outcome == "failed":
            self.counters.failed_attempts += 1
        record.attempts += 1
        if record.gen == gen:  # a re-mark already set its own due time
            record.due = trio.current_time() + min(self.retry_s * record.attempts, self.max_retry_s)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- flush -----------------------------------------------------------------------------------

    async def flush(self) -> FlushResult:
        """Make every dirty record durable now; concurrent callers share one flush."""
        if self._flight is not None:
            flight = self._flight
            await flight.wait()
            return self._flight_result or self.result(durable=False)
        self._flight = flight = trio.Event()
        self._flight_result = None
        try:
            self._flight_result = await self._flush()
            return self._flight_result
        finally:
            self._flight = None
            flight.set()

    async def _flush(self) -> FlushResult:
        started = trio.current_time()
        spills = self._spills
        lost0 = spills.counters.dropped + spills.counters.failed - self._own_losses
        flushed = missing = evicted = 0
        self._take_inbox()  # marks already posted (a put just before the flush) count
        self._flushing = True
        self._poke()
        try:
            with spills.forcing():
                while self._running_attempts:  # attempts already under way settle first
                    changed = self._changed
                    await changed.wait()
                await spills.drain()
                for _ in range(MAX_FLUSH_PASSES):
                    progress = False
                    # Longest first: a superseded ancestor is then covered by its stored descendant.
                    for key in sorted(self.records, key=lambda k: -len(k[1])):
                        record = self.records.get(key)
                        if record is None or record.running:
                            continue
                        record.running = True
                        gen = record.gen
                        try:
                            outcome = await self._store(key)
                        except Exception:  # noqa: BLE001
                            log.exception("durability flush attempt failed")
                            outcome = "failed"
                        finally:
                            record.running = False
                        await spills.drain()  # one at a time: the cap never drops a flush item
                        self._settle(key, record, gen, outcome)
                        if outcome == "stored":
                            flushed += 1
                            progress = True
                        elif outcome == "evicted":
                            evicted += 1
                            progress = True
                        elif outcome == "missing":
                            missing += 1
                            progress = True
                    if not progress or not self.records:
                        break
        finally:
            self._flushing = False
            self._poke()
        # Drops or failures of spills no record backs (demotions) are entries lost for good.
        lost = spills.counters.dropped + spills.counters.failed - self._own_losses - lost0
        durable = not self.records and spills.pending == 0 and lost == 0 and missing == 0
        if evicted:
            log.info(
                "flush: %d entr%s already evicted by the SSD size cap (not lost)",
                evicted,
                "y" if evicted == 1 else "ies",
            )
        return self.result(durable=durable, flushed=flushed, missing=missing, elapsed_s=trio.current_time() - started)

    def result(self, *, durable: bool, flushed: int = 0, missing: int = 0, elapsed_s: float = 0.0) -> FlushResult:
        spills = self._spills
        return FlushResult(
            durable=durable,
            flushed_snapshots=flushed,
            missing_snapshots=missing,
            pending_snapshots=len(self.records),
            pending_spills=spills.pending,
            pending_spill_bytes=spills.pending_bytes,
            dropped_spills=spills.counters.dropped,
            failed_spills=spills.counters.failed,
            elapsed_ms=round(elapsed_s * 1000, 3),
        )


# --- the SSD tier as the root wires it ----------------------------------------------------------


@attrs.define(eq=False)
class SsdTier:
    """The SSD tier's actors and their sources, for the root, /stats and the flush route."""

    worker: SsdWorker
    store: SsdStore
    cache: TierCounters  # cache.tiered.TieredPromptCache (worker-thread ints, read-only here)
    spills: SpillQueue
    durability: Durability
    demotion: DemotionTimer | None = None  # None with --ssd-demote-idle 0

    async def quiesce(self) -> None:
        """Wait for every worker job already asked for (a finished row's close_row put), then
        for the marks those puts posted, so a flush right after a response includes its put."""
        await self.worker.run_exclusive(lambda engine: None)
        await trio.sleep(0)  # the put hook's run_sync_soon callbacks ran before the reply

    async def flush(self) -> FlushResult:
        try:
            await self.quiesce()
        except Exception:  # noqa: BLE001 - a dead worker: flush what is already queued
            log.warning("flush: the GPU worker is gone; flushing what is already queued")
        return await self.durability.flush()

    def stop_timers(self) -> None:
        if self.demotion is not None:
            self.demotion.stop()

    async def shutdown_flush(self, *, timeout: float) -> FlushResult:
        return await shutdown_flush(self, timeout=timeout)

    def stats(self) -> dict[str, Any]:
        store, spills = self.store, self.spills
        return {
            "dir": str(store.dir),
            "entries": len(store),
            "bytes": store.nbytes,
            "max_bytes": store.max_bytes,
            "restores": self.cache.restores,
            "spills": store.stats.writes,
            "restore_ms_last": round(self.cache.restore_ms_last),
            "demotions": self.cache.demotions,
            "pending_snapshots": self.durability.pending_snapshots,
            "pending_spills": spills.pending,
            "pending_spill_bytes": spills.pending_bytes,
            "dropped_spills": spills.counters.dropped,
            "failed_spills": spills.counters.failed,
            "longest_durable_prefix_tokens": store.longest_durable_prefix_tokens,
            "verify": store.verify,
            "restore_failures": store.stats.restore_failures,
            "quarantined": store.stats.quarantined,
            "reaped_temp_files": store.stats.reaped_temp,
        }


async def start_ssd_tier(
    nursery: trio.Nursery,
    worker: object,
    *,
    busy: Callable[[], bool],
    spill_queue_bytes: int,
    demote_idle_s: float,
) -> SsdTier | None:
    """Start spill_queue, durability and demotion_timer when the worker opened an SSD store."""
    store = getattr(worker, "ssd_store", None)
    if store is None:
        return None
    tier_worker = cast(SsdWorker, worker)  # a worker that opened a store serves the SSD surface

    # A store may bring its own blocking-call runner (test doubles run inline on virtual time).
    spills = SpillQueue(
        store, cap_bytes=spill_queue_bytes, idle=lambda: not busy(), run_blocking=getattr(store, "run_blocking", None)
    )
    await nursery.start(spills.run)
    durability = Durability(tier_worker, spills, busy=busy, evicted_by_cap=getattr(store, "evicted_by_cap", None))
    await nursery.start(durability.run)
    tier_worker.set_put_listener(durability.listener)
    demotion = None
    if demote_idle_s > 0:
        demotion = DemotionTimer(tier_worker, spills, busy=busy, idle_s=demote_idle_s)
        await nursery.start(demotion.run)
    return SsdTier(
        worker=tier_worker,
        store=store,
        cache=tier_worker.prompt_cache,
        spills=spills,
        durability=durability,
        demotion=demotion,
    )


async def shutdown_flush(tier: SsdView | None, *, timeout: float) -> FlushResult:
    """Stop the timers, then flush within `timeout`; the result is logged either way. A tier in
    another process (an isolated engine's) flushes there."""
    if tier is None:
        return FlushResult(durable=True)
    if not isinstance(tier, SsdTier):
        return await tier.shutdown_flush(timeout=timeout)
    tier.stop_timers()
    started = trio.current_time()
    result: FlushResult | None = None
    with trio.move_on_after(timeout):
        result = await tier.flush()
    if result is None:
        result = tier.durability.result(durable=False, elapsed_s=trio.current_time() - started)
        log.warning("shutdown flush overran %.0f s: %s", timeout, _describe(result))
    elif result.durable:
        log.info("shutdown flush: durable (%s)", _describe(result))
    else:
        log.warning("shutdown flush: NOT durable (%s)", _describe(result))
    return result


def _describe(r: FlushResult) -> str:
    return (
        f"flushed {r.flushed_snapshots}, missing {r.missing_snapshots}, pending snapshots "
        f"{r.pending_snapshots}, pending spills {r.pending_spills}, dropped {r.dropped_spills}, "
        f"failed {r.failed_spills}, {r.elapsed_ms:.0f} ms"
    )
