"""Spill-queue actor: the bounded write-behind queue in front of the SSD store.

Inbound:  `inbox` — `Spill(item, reply)` from durability and demotion_timer (unbounded; senders
          go through `submit` / `submit_nowait`, which `send_nowait` on it and count the message
          as pending until it is received). The byte cap is applied the moment it is received.
Outbound: one `SpillDone` on each Spill's `reply`; file writes through `store` (begin / write_next
          / commit / abort), each call on a worker thread that is never the MLX one.

Items are written strictly one at a time, oldest first. Over the cap the oldest queued item that
is neither in flight nor the one just received is dropped and its KV views released: a future
cache miss, never a wrong result (the durability record stays dirty, so a flush can retry).

Disk writes never delay a decode step: the GPU-worker only ever spends the zero-copy snapshot on
a spill (see docs/ssd-cache.md for the measurement), and each piece (<= 4 MiB) waits until
`idle()` holds (no rows running or queued) unless a flush is forcing the queue.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import attrs
import trio

from actors.messages import Spill, SpillDone
from cache.spill_item import SpillItem

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05

# Runs a blocking store call (`fn(*args)`) off the trio thread and returns its result.
RunBlocking = Callable[..., Awaitable[Any]]


class SpillWriter(Protocol):
    """One file being written (cache.ssd_writer.SsdWriter)."""

    def write_next(self) -> bool: ...

    def commit(self) -> bool: ...

    def abort(self) -> None: ...


class SpillStore(Protocol):
    """Where spills go (cache.ssd_store.SsdStore): a writer per item, None when refused."""

    def begin(self, item: SpillItem) -> SpillWriter | None: ...


@attrs.define
class SpillCounters:
    stored: int = 0
    dropped: int = 0  # over the byte cap
    failed: int = 0  # the store refused, threw or returned False


@attrs.define(eq=False)
class _Pending:
    item: SpillItem
    key: tuple[str, tuple[int, ...]]
    nbytes: int
    reply: trio.MemorySendChannel | None
    done: trio.Event = attrs.Factory(trio.Event)
    stored: bool = False


class SpillQueue:
    def __init__(
        self,
        store: SpillStore,
        *,
        cap_bytes: int,
        idle: Callable[[], bool],
        poll_s: float = IDLE_POLL_S,
        run_blocking: RunBlocking | None = None,
    ) -> None:
        self.store = store
        self.cap_bytes = max(0, int(cap_bytes))
        self._idle = idle
        self._poll_s = poll_s
        if run_blocking is None:
            run_blocking = partial(trio.to_thread.run_sync, limiter=trio.CapacityLimiter(1))
        self._run = run_blocking
        self.inbox, self._inbox_recv = trio.open_memory_channel[Spill](math.inf)
        self.counters = SpillCounters()
        self._queue: deque[_Pending] = deque()
        self._inflight: _Pending | None = None
        self._by_key: dict[tuple[str, tuple[int, ...]], _Pending] = {}
        self._bytes = 0
        self._in_transit = 0  # sent through `submit*` but not yet received by the actor
        self._forced = 0
        self._wake = trio.Event()
        self._changed = trio.Event()

    # -- views -----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._queue) + (self._inflight is not None) + self._in_transit

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    # -- the actor -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive)
                task_status.started()
                await self._write_loop()
        finally:
            for p in [*self._queue, *([self._inflight] if self._inflight else [])]:
                self._finish(p, False, "cancelled")
            self._queue.clear()
            self._inflight = None

    async def _receive(self) -> None:
        async for message in self._inbox_recv:
            self._accept(message)

    def _accept(self, message: Spill) -> None:
        self._in_transit = max(0, self._in_transit - 1)
        item = message.item
        p = _Pending(item=item, key=(item.namespace, item.tokens), nbytes=item.nbytes, reply=message.reply)
        self._queue.append(p)
        self._by_key[p.key] = p
        self._bytes += p.nbytes
        while self._bytes > self.cap_bytes:
            victim = next((q for q in self._queue if q is not p), None)
            if victim is None:
                break  # soft cap: the newest item and the one in flight always stay
            self._queue.remove(victim)
            self.counters.dropped += 1
            log.info(
                "spill queue over its %.2f GiB cap: dropped a %d-token entry (a future miss)",
                self.cap_bytes / 2**30,
                len(victim.key[1]),
            )
            self._finish(victim, False, "dropped")
        self._wake.set()
        self._signal()

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            p = self._queue.popleft()
            self._inflight = p
            stored, reason = await self._write(p.item)
            self._inflight = None
            if stored:
                self.counters.stored += 1
            else:
                self.counters.failed += 1
            self._finish(p, stored, reason)

    async def _write(self, item: SpillItem) -> tuple[bool, str]:
        try:
            await self._wait_idle()  # begin writes the header: it waits like every piece
            writer = await self._run(self.store.begin, item)
        except Exception as e:  # noqa: BLE001 - the cache tier never takes serving down
            log.warning("SSD spill could not start: %s", e)
            return False, "failed"
        if writer is None:
            return False, "refused"
        try:
            while True:
                await self._wait_idle()
                if not await self._run(writer.write_next):
                    break
            stored = await self._run(writer.commit)
            return bool(stored), "stored" if stored else "failed"
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self._run(writer.abort)
            raise
        except Exception as e:  # noqa: BLE001
            log.warning("SSD spill failed: %s", e)
            await self._run(writer.abort)
            return False, "failed"

    async def _wait_idle(self) -> None:
        while not (self._forced or self._idle()):
            await trio.sleep(self._poll_s)

    def _finish(self, p: _Pending, stored: bool, reason: str) -> None:
        self._bytes -= p.nbytes
        p.stored = stored
        p.done.set()
        if p.reply is not None:
            try:
                p.reply.send_nowait(SpillDone(stored, reason))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass
        if self._by_key.get(p.key) is p:
            del self._by_key[p.key]
        try:
            p.item.release()  # the KV views go now, on every exit path
        except Exception:  # noqa: BLE001
            pass
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- for durability, demotion and flush ---------------------------------------------------------

    async def submit(self, item: SpillItem) -> bool:
        """Queue `item` and wait until it is stored (True) or dropped / refused / failed (False)."""
        return (await self.submit_outcome(item)).stored

    async def submit_outcome(self, item: SpillItem) -> SpillDone:
        send, recv = trio.open_memory_channel[SpillDone](1)
        with recv:
            try:
                self.inbox.send_nowait(Spill(item, send))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                item.release()
                return SpillDone(False, "cancelled")
            self._in_transit += 1
            try:
                return await recv.receive()
            except trio.EndOfChannel:
                return SpillDone(False, "cancelled")

    def submit_nowait(self, item: SpillItem) -> None:
        try:
            self.inbox.send_nowait(Spill(item))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            item.release()
            return
        self._in_transit += 1

    async def wait_for(self, namespace: str, tokens: tuple[int, ...]) -> bool | None:
        """If a spill of exactly these tokens is queued or in flight, its outcome; else None."""
        while self._in_transit:
            changed = self._changed
            await changed.wait()  # the receive task takes in what was sent before us
        p = self._by_key.get((namespace, tuple(tokens)))
        if p is None:
            return None
        await p.done.wait()
        return p.stored

    async def drain(self) -> None:
        """Return once nothing is queued, received-but-unseen or in flight."""
        while self.pending:
            changed = self._changed
            await changed.wait()

    @contextmanager
    def forcing(self) -> Iterator[None]:
        """Write without waiting for idle (a flush: the caller wants it on disk now)."""
        self._forced += 1
        try:
            yield
        finally:
            self._forced -= 1
