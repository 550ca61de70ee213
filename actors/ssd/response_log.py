"""Response log actor: the durable Responses store (`--response-store DIR`, or DIR/responses under
`--ssd-cache`), so `previous_response_id`, GET and DELETE survive restarts and crashes.

Inbound:  `put` / `delete` calls from the Responses routes, each an op on the actor's channel
          (unbounded), awaited until its batch is on disk; `get` reads on a thread of its own.
Outbound: writes, reads and unlinks on worker threads (actors/ssd/response_records.py); nothing
          on the event loop touches the disk or serializes a record.

Write-behind with group commit: the writer takes every op queued, writes the batch on one thread
call (each record fsync'd, renamed, each directory fsync'd once) and answers them all, so
concurrent responses share the fsyncs. A caller that awaits `put` holds a durable record: the
Responses route does so before it sends the final event or the body (`store: true` survives a
kill -9 once answered). Records expire `ttl_s` after they were stored (a sweep every
`sweep_s`, and reads check it) and, over `max_bytes`, the least recently used go first. A record
that fails verification, at the start-up scan or at a read, is logged, quarantined and absent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from actors.ssd.response_records import RecordCorrupt, RecordDir, RecordMeta, StoreUnavailable
from actors.startup import StartupFailed
from model.options import ResponsesOptions, ServerOptions

log = logging.getLogger(__name__)

T = TypeVar("T")
RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]
DURABLE_TTL_S = 30 * 24 * 3600.0  # --response-store-ttl's auto with a durable store
MEMORY_TTL_S = 3600.0  # and in memory alone
MAX_BATCH = 64
RESPONSE_DRAIN_S = 10.0  # what shutdown waits for ops still queued (answered puts are already on disk)
SUBDIR = "responses"  # under --ssd-cache


def store_ttl(options: ResponsesOptions, durable: bool) -> float:
    """--response-store-ttl, its auto resolved: 30 days on disk, an hour in memory."""
    if options.response_store_ttl_s is not None:
        return options.response_store_ttl_s
    return DURABLE_TTL_S if durable else MEMORY_TTL_S


def store_dir(options: ServerOptions) -> Path | None:
    """Where stored responses are kept: --response-store DIR, else DIR/responses under
    --ssd-cache; None in memory alone (`--response-store memory`, or neither flag)."""
    chosen = options.responses.response_store
    if chosen == "memory":
        return None
    if chosen is not None:
        return Path(chosen)
    if options.caches.ssd_cache_dir:
        return Path(options.caches.ssd_cache_dir) / SUBDIR
    return None


@attrs.define
class LogCounters:
    writes: int = 0  # records made durable
    batches: int = 0  # fsync'd batches they took
    write_failures: int = 0
    refused: int = 0  # records over the size cap on their own
    reads: int = 0  # records read back from disk
    corrupt: int = 0  # records that failed verification (at start or at a read): skipped
    expired: int = 0
    evicted: int = 0  # pushed out by the size cap
    deleted: int = 0
    last_batch: int = 0  # records in the last batch
    last_write_ms: float = 0.0  # how long the last batch took on its thread


@attrs.define(eq=False)
class _Op:
    kind: str  # "put" | "remove"
    record: dict[str, Any] | None = None
    paths: list[Path] = attrs.Factory(list)
    done: trio.Event = attrs.Factory(trio.Event)
    ok: bool = False


class ResponseLog:
    def __init__(
        self,
        records: RecordDir,
        *,
        ttl_s: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
        run_blocking: RunBlocking[Any] | None = None,
        sweep_s: float = 60.0,
    ) -> None:
        self.records = records
        self.ttl_s = ttl_s
        self.max_bytes = max(0, int(max_bytes))
        self.sweep_s = sweep_s
        self._clock = clock
        self._run: RunBlocking[Any] = run_blocking or trio.to_thread.run_sync
        self.index: dict[str, RecordMeta] = {}
        self.counters = LogCounters()
        self._send, self._recv = trio.open_memory_channel[_Op](math.inf)
        self._idle = trio.Event()
        self._idle.set()
        self._pending = 0

    @property
    def nbytes(self) -> int:
        return sum(meta.nbytes for meta in self.index.values())

    async def open(self) -> ResponseLog:
        """Lock the directory and verify every record (on a thread); raises StoreUnavailable."""
        found = await self._run(lambda: self.records.open(self._clock()))
        self.index = {meta.id: meta for meta in found}
        self.counters.corrupt = self.records.quarantined
        self._evict()
        log.info(
            "response store %s: %d responses, %.1f MiB (cap %.1f GiB, kept %.0f days)",
            self.records.root,
            len(self.index),
            self.nbytes / 2**20,
            self.max_bytes / 2**30,
            self.ttl_s / 86400,
        )
        return self

    # -- the actor -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sweeper)
                task_status.started()
                await self._writer()
        finally:
            self.records.close()  # the directory's lock goes with the actor

    async def _writer(self) -> None:
        async for first in self._recv:
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._recv.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await self._apply(batch)
            finally:
                for op in batch:
                    op.done.set()
                self._pending -= len(batch)
                if not self._pending:
                    self._idle.set()

    async def _apply(self, batch: list[_Op]) -> None:
        puts = [op for op in batch if op.kind == "put" and op.record is not None]
        removals = [path for op in batch if op.kind == "remove" for path in op.paths]
        started = time.perf_counter()

        def io() -> list[RecordMeta | Exception]:
            # Removals first: a put queued after a delete of the same id (a new response never
            # reuses an id) is not undone by it.
            self.records.remove(removals)
            return self.records.write([op.record for op in puts if op.record is not None], self._clock())

        try:
            results = await self._run(io)
        except Exception as e:  # noqa: BLE001 - the store never takes serving down
            results = [e] * len(puts)
        self.counters.batches += 1
        self.counters.last_batch = len(batch)
        self.counters.last_write_ms = round((time.perf_counter() - started) * 1000, 3)
        for op in batch:
            op.ok = op.kind == "remove"
        for op, result in zip(puts, results):
            if isinstance(result, RecordMeta):
                op.ok = True
                self.index[result.id] = result
                self.counters.writes += 1
            else:
                self.counters.write_failures += 1
                log.warning("response store: a response could not be written (%s); it is kept in memory only", result)
        self._evict()

    async def _sweeper(self) -> None:
        while True:
            await trio.sleep(self.sweep_s)
            now = self._clock()
            expired = [meta for meta in self.index.values() if meta.expires_at <= now]
            for meta in expired:
                del self.index[meta.id]
            if expired:
                self.counters.expired += len(expired)
                self._submit(_Op("remove", paths=[meta.path for meta in expired]))

    def _submit(self, op: _Op) -> _Op:
        self._pending += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._send.send_nowait(op)
        return op

    def _evict(self) -> None:
        """Least recently used first, down to the size cap."""
        total = self.nbytes
        victims = []
        for meta in sorted(self.index.values(), key=lambda m: m.last_used):
            if total <= self.max_bytes:
                break
            del self.index[meta.id]
            total -= meta.nbytes
            victims.append(meta.path)
        if victims:
            self.counters.evicted += len(victims)
            self._submit(_Op("remove", paths=victims))

    # -- calls -----------------------------------------------------------------------------------

    async def put(self, record: dict[str, Any]) -> bool:
        """Write `record` ({id, created_at, expires_at, input, output, instructions, response});
        True once it is durable, False when it could not be (it stays in memory only)."""
        op = self._submit(_Op("put", record=record))
        await op.done.wait()  # (a caller cancelled meanwhile leaves the op queued: it is written)
        return op.ok

    async def get(self, rid: str) -> dict[str, Any] | None:
        """The verified record of `rid`, or None (absent, expired, or corrupt: then quarantined)."""
        meta = self.index.get(rid)
        if meta is None:
            return None
        if meta.expires_at <= self._clock():
            return None  # (the sweep removes it)
        try:
            record = await self._run(lambda: self.records.read(meta))
        except (OSError, RecordCorrupt) as e:
            if self.index.get(rid) is meta:
                del self.index[rid]
            if isinstance(e, RecordCorrupt):
                self.counters.corrupt += 1
                reason = str(e)
                await self._run(lambda: self.records.quarantine(meta.path, reason))
            else:
                log.warning("response store: cannot read %s (%s); answered as not found", meta.path.name, e)
            return None
        meta.last_used = self._clock()
        self.counters.reads += 1
        return record

    async def delete(self, rid: str) -> bool:
        """Forget `rid` and remove its record (awaited); whether it was on disk."""
        meta = self.index.pop(rid, None)
        try:
            path = self.records.path_of(rid)
        except ValueError:
            return False
        op = self._submit(_Op("remove", paths=[path]))
        await op.done.wait()
        if meta is not None:
            self.counters.deleted += 1
        return meta is not None

    async def drain(self) -> None:
        """Wait until every op queued so far is on disk (shutdown)."""
        await self._idle.wait()

    def record(self, rid: str, **fields: Any) -> dict[str, Any]:
        """A record of `fields` (input, output, instructions, response) stored now."""
        now = self._clock()
        return {"id": rid, "created_at": now, "expires_at": now + self.ttl_s, **fields}

    def stats(self) -> dict[str, Any]:
        return {
            "dir": str(self.records.root),
            "entries": len(self.index),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "ttl_s": self.ttl_s,
            "reaped_temp_files": self.records.reaped_temp,
            **attrs.asdict(self.counters),
        }


async def start_response_log(nursery: trio.Nursery, options: ServerOptions) -> ResponseLog | None:
    """Open and start the durable store the options ask for; None in memory alone. A directory
    that cannot be used fails start-up (one line, exit 2), or, when it is the one under
    `--ssd-cache` and `--ssd-optional` is set, is a warning and responses stay in memory."""
    root = store_dir(options)
    if root is None:
        return None
    ttl = store_ttl(options.responses, durable=True)
    max_bytes = int(options.responses.response_store_max_gb * 2**30)
    try:
        store = await ResponseLog(RecordDir(root), ttl_s=ttl, max_bytes=max_bytes).open()
    except StoreUnavailable as e:
        implicit = options.responses.response_store is None
        if implicit and options.caches.ssd_optional:
            log.warning("response store disabled (--ssd-optional): %s; stored responses stay in memory", e)
            return None
        raise StartupFailed(f"--response-store: {e}", usage=True) from e
    await nursery.start(store.run)
    return store
