"""The model pool: several models in one server, loaded on demand, the least recently used idle
one unloaded to make room (`--model-pool N`, `--models-dir DIR`, `--model-ttl S`).

Each resident model is a member: its own GPU worker (its `Engine`, on the server's one MLX
thread: actors/mlx_thread.py), scheduler, admission and SSD-tier actors, started by the root's
`start_actors` in a nursery of the member's own and reached through its own `ServerHandles`.
Per-model queues and batches: a slow model never holds another's admission, and their schedulers'
worker calls interleave on the MLX thread one job at a time.

* `acquire(name)` — what every generation route calls with the request's `model`: the member's
  handles, loading it first when it is not resident (the request waits, at most
  `--model-load-timeout`, then `PoolBusy`, 503). A full pool unloads its least recently used idle
  member; a member with running, queued or arriving rows is never chosen. The route enters the
  member's arrivals with no checkpoint after `acquire` returns, so the member it got is busy
  from then until its request ends.
* `unload(name)` and `--model-ttl` — a leaving member takes no new request (one naming it waits
  for it to be gone, then loads it again), lets its running rows end, demotes its whole RAM
  prompt cache to the SSD tier (actors/ssd/drain.py: the warm return, keyed by the model's
  identity), then its actors are cancelled and its worker drops the engine.
* `drain(name)` — the same without leaving: requests wait meanwhile, then it serves again.
* Memory: each member's admission ceiling, live-KV budget and prompt-cache room leave out every
  other resident member's weights (`ServerHandles.bill_other_models`), re-billed whenever one
  comes or goes; a load that would not fit the budget beside the resident weights (estimated
  from its safetensors files) makes room first.

Shutdown (actors/root.py): `close` shuts every member's admission and refuses new loads;
`wait_idle` waits for every member; `shutdown_flush` flushes every member's SSD tier.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from actors.handles import ServerHandles
from actors.messages import FlushResult
from actors.mlx_thread import MlxThread
from actors.model_catalog import ModelCatalog, Servable
from actors.pool_types import (
    ModelBusy,
    ModelLoadFailed,
    ModelNotLoaded,
    ModelUnknown,
    PoolBusy,
    PoolClosed,
    PoolEntry,
)
from actors.ssd.drain import DrainReport, drain_to_ssd
from actors.ssd.durability import shutdown_flush
from actors.ssd.view import SsdView
from actors.startup import find

log = logging.getLogger(__name__)

# A member's load and its actors, in the nursery it is handed (actors/root.py `start_actors`).
StartMember = Callable[[trio.Nursery, Servable], Awaitable[ServerHandles]]
State = Literal["loading", "loaded", "draining", "leaving"]
POLL_S = 0.05  # how often a wait for room or for a member's last row looks again
# A failed load is answered again, without another attempt (or another model unloaded to make
# room for one), for as long as its Retry-After says.
FAILED_LOAD_HOLD_S = ModelLoadFailed.retry_after


@attrs.define
class PoolCounters:
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0  # left to make room (least recently used)
    expirations: int = 0  # left after --model-ttl idle
    unloads: int = 0  # left on POST /admin/models/unload


@attrs.define(eq=False)
class Member:
    model: Servable
    state: State = "loading"
    handles: ServerHandles | None = None
    ready: trio.Event = attrs.Factory(trio.Event)  # set while it takes requests (or its load failed)
    leave: trio.Event = attrs.Factory(trio.Event)  # set to ask it to leave
    gone: trio.Event = attrs.Factory(trio.Event)
    error: str | None = None
    exception: Exception | None = None  # what its load raised
    last_used: float = 0.0  # trio time of its last acquire, or of its last request's end
    loaded_at: float | None = None  # wall clock
    drained: DrainReport = DrainReport()  # what its last drain did

    @property
    def id(self) -> str:
        return self.model.id

    def busy(self) -> bool:
        """Rows running, queued, or a request on its way in (between `acquire` and admission)."""
        h = self.handles
        if h is None:
            return self.state == "loading"
        sched = h.scheduler
        return bool(
            h.admission.in_flight or h.arrivals.pending or sched.busy or sched.pending_rows(h.admission.enqueued)
        )


class ModelPool:
    def __init__(
        self,
        catalog: ModelCatalog,
        start_member: StartMember,
        *,
        size: int,
        ttl_s: float = 0.0,
        load_timeout_s: float = 300.0,
        thread: MlxThread | None = None,
    ) -> None:
        self.catalog = catalog
        self.size = size
        self.ttl_s = ttl_s
        self.load_timeout_s = load_timeout_s
        self.thread = thread
        self.budget_bytes: int | None = None  # known once the first model has loaded
        self.members: dict[str, Member] = {}
        self.counters = PoolCounters()
        self.closed = False
        self.cutoff = math.inf
        self._start_member = start_member
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.had_ssd = False  # some member opened an SSD tier (a shutdown flush was owed)
        self._app_handles: ServerHandles | None = None  # the default's first load: the app's (/health)
        self._failed: dict[str, tuple[float, str]] = {}  # model id -> (trio time, why) of its last failed load
        self._making_room: dict[str, Member] = {}  # model id -> the member leaving to make room for it

    # -- the actor

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.ttl_s > 0:
                nursery.start_soon(self._expire_idle)
            task_status.started()
            await trio.sleep_forever()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- what the app asks (ModelPoolView)

    def find(self, name: str) -> str | None:
        found = self.catalog.find(name)
        return None if found is None else found.id

    def alive(self) -> bool:
        return self.thread is None or self.thread.alive

    def failed(self) -> dict[str, str]:
        """Resident members whose isolated engine failed for good (unloading one clears it)."""
        failures = {m.id: m.handles.worker_failure() for m in self.members.values() if m.handles is not None}
        return {model_id: why for model_id, why in failures.items() if why is not None}

    def resident(self, model_id: str) -> ServerHandles | None:
        member = self.members.get(model_id)
        return member.handles if member is not None and member.state != "loading" else None

    def entries(self) -> list[PoolEntry]:
        now = trio.current_time()
        ids = list(dict.fromkeys([*self.catalog.listed(), *self.members]))
        return [self._entry(model_id, now) for model_id in ids]

    def _entry(self, model_id: str, now: float) -> PoolEntry:
        default = model_id == self.catalog.default.id
        member = self.members.get(model_id)
        if member is None:
            return PoolEntry(model_id, "unloaded", default=default)
        if member.state == "loading" or member.handles is None:
            return PoolEntry(model_id, "loading", default=default)
        failure = member.handles.worker_failure()
        return PoolEntry(
            model_id,
            "loaded" if failure is None else "failed",
            error=failure,
            weights_bytes=member.handles.info.weights_bytes,
            loaded_at=member.loaded_at,
            idle_s=None if member.busy() else round(max(0.0, now - member.last_used), 3),
            default=default,
        )

    def stats(self) -> dict[str, Any]:
        now = trio.current_time()
        models: dict[str, Any] = {}
        for member in self.members.values():
            entry = attrs.asdict(self._entry(member.id, now))
            if member.handles is not None and member.state != "loading":
                block = member.handles.model_stats()
                if not member.handles.options.engine.isolate:  # (isolated: each engine's own thread)
                    block.pop("worker", None)  # (one MLX thread: the top level shows it once)
                entry.update(block)
            models[member.id] = entry
        return {"size": self.size, "ttl_s": self.ttl_s, **attrs.asdict(self.counters), "resident": models}

    async def start(self) -> ServerHandles:
        """Load the default model (start-up: no timeout; its load's own exception is raised)."""
        member = await self._admit(self.catalog.default)
        await member.ready.wait()
        if member.exception is not None:
            raise member.exception
        assert member.handles is not None
        self._app_handles = member.handles
        return member.handles

    async def acquire(self, name: str) -> ServerHandles:
        model = self.catalog.find(name)
        if model is None:
            raise ModelUnknown(f"The model `{name}` does not exist")
        with trio.move_on_after(self.load_timeout_s):
            member = await self._ready(model)
            member.last_used = trio.current_time()
            self._poke()
            assert member.handles is not None
            return member.handles
        raise PoolBusy(
            f"the model `{model.id}` did not load within {self.load_timeout_s:.0f} s (the pool is full of busy "
            "models, or loading is slow); retry later",
        )

    async def unload(self, name: str, *, wait: bool = True) -> DrainReport:
        model = self._known(name)
        member = self.members.get(model.id)
        if member is None:
            return DrainReport()
        if not wait and member.busy():
            raise ModelBusy(f"the model `{model.id}` has running requests (an unload without `force: false` waits)")
        if member.state == "loading":
            await member.ready.wait()
        self.counters.unloads += 1
        self._ask_leave(member, "unloaded by request")
        await member.gone.wait()
        return member.drained

    async def drain(self, name: str) -> DrainReport:
        model = self._known(name)
        member = self.members.get(model.id)
        if member is None or member.handles is None:
            raise ModelNotLoaded(f"the model `{model.id}` is not loaded: there is nothing to drain")
        await member.ready.wait()
        if member.state != "loaded":  # (it is leaving, which drains it anyway)
            await member.gone.wait()
            return member.drained
        member.state, member.ready = "draining", trio.Event()
        try:
            await self._drain(member)
        finally:
            if member.state == "draining":
                member.state = "loaded"
            member.ready.set()
            self._poke()
        return member.drained

    def _known(self, name: str) -> Servable:
        model = self.catalog.find(name)
        if model is None:
            raise ModelUnknown(f"The model `{name}` does not exist")
        return model

    # -- loading and making room

    async def _ready(self, model: Servable) -> Member:
        while True:
            if self.closed:
                raise PoolClosed("server is shutting down")
            member = self.members.get(model.id)
            failed = self._failed.get(model.id)
            if member is None and failed is not None and trio.current_time() < failed[0] + FAILED_LOAD_HOLD_S:
                raise ModelLoadFailed(f"the model `{model.id}` failed to load: {failed[1]}")
            if member is None:
                member = await self._admit(model)
            if member.state == "leaving":
                await member.gone.wait()
                continue
            await member.ready.wait()
            if member.error is not None:
                raise ModelLoadFailed(f"the model `{model.id}` failed to load: {member.error}")
            if self.closed:  # (the shutdown began during its load: a request not admitted yet is refused)
                raise PoolClosed("server is shutting down")
            if member.state == "loaded":
                return member

    async def _admit(self, model: Servable) -> Member:
        """A new member for `model`, once the pool has room for it (its load started)."""
        estimate = _weights_estimate(model.path)
        while True:
            if self.closed:
                raise PoolClosed("server is shutting down")
            existing = self.members.get(model.id)
            if existing is not None:  # (another request started it meanwhile)
                return existing
            if self._has_room(estimate):
                break
            # Concurrent requests for one model share its evictions: a later one waits for the
            # victim an earlier one chose (leaving, not gone yet) instead of evicting another.
            victim = self._making_room.get(model.id)
            if victim is None or victim.gone.is_set():
                victim = self._victim()
                if victim is not None:
                    self.counters.evictions += 1
                    self._ask_leave(victim, f"least recently used, making room for {model.id}")
                    self._making_room[model.id] = victim
            if victim is not None:
                await victim.gone.wait()
            else:
                await trio.sleep(POLL_S)  # every member is busy: wait for one to go idle
        self._making_room.pop(model.id, None)
        member = Member(model, last_used=trio.current_time())
        self.members[model.id] = member
        assert self._nursery is not None, "the pool is not running"
        self._nursery.start_soon(self._host, member)
        return member

    def _has_room(self, estimate: int) -> bool:
        if len(self.members) >= self.size:
            return False
        if self.budget_bytes is None or not self.members:
            return True
        return self._resident_bytes() + estimate <= self.budget_bytes

    def _resident_bytes(self) -> int:
        return sum(m.handles.info.weights_bytes for m in self.members.values() if m.handles is not None)

    def _victim(self) -> Member | None:
        idle = [m for m in self.members.values() if m.state == "loaded" and not m.busy()]
        return min(idle, key=lambda m: m.last_used, default=None)

    def _ask_leave(self, member: Member, why: str) -> None:
        if not member.leave.is_set():
            log.info("model %s leaves the pool (%s)", member.id, why)
            member.leave.set()

    # -- a member's life

    async def _host(self, member: Member) -> None:
        started = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                try:
                    handles = await self._start_member(nursery, member.model)
                except Exception as exc:
                    self.counters.load_failures += 1
                    cause = find(exc, Exception) or exc  # (an isolated engine's start fails inside a group)
                    member.error, member.exception = str(cause) or type(cause).__name__, exc
                    self._failed[member.id] = (trio.current_time(), member.error)
                    log.error("model %s failed to load: %s", member.id, member.error)
                    nursery.cancel_scope.cancel()
                    return
                handles.pool = self
                member.handles = handles
                if self.closed:  # (loaded during the shutdown: it admits nothing, as every other member)
                    handles.admission.close(cutoff_after=max(0.0, self.cutoff - trio.current_time()))
                member.loaded_at = time.time()
                member.state = "loaded"
                member.last_used = trio.current_time()
                handles.admission.on_idle = lambda: self._went_idle(member)
                self.had_ssd = self.had_ssd or handles.ssd is not None
                if self.budget_bytes is None:
                    self.budget_bytes = handles.resolved.memory_budget_bytes
                self.counters.loads += 1
                self._bill()
                log.info("model %s loaded in %.1f s", member.id, time.monotonic() - started)
                member.ready.set()
                self._poke()
                await member.leave.wait()
                if not self.closed:  # (at shutdown the root flushes every member instead)
                    member.state = "leaving"
                    await self._drain(member)
                nursery.cancel_scope.cancel()
        finally:
            if self.members.get(member.id) is member:
                del self.members[member.id]
            member.state = "leaving"
            member.ready.set()
            member.gone.set()
            self._bill()
            self._poke()

    def _went_idle(self, member: Member) -> None:
        member.last_used = trio.current_time()
        self._poke()

    async def _drain(self, member: Member) -> None:
        """Let the member's rows end, then demote its RAM prompt cache to the SSD tier."""
        handles = member.handles
        assert handles is not None
        while member.busy():
            await handles.admission.wait_idle()
            if member.busy():
                await trio.sleep(POLL_S)
        try:
            member.drained = await drain_to_ssd(handles.ssd, handles.worker)
        except Exception:  # noqa: BLE001 - a failed demotion loses cache entries, never a request
            log.exception("model %s: the drain to the SSD tier failed", member.id)
            member.drained = DrainReport(durable=False)

    def _bill(self) -> None:
        """Each resident member's budgets leave out every other one's weights."""
        resident = [m for m in self.members.values() if m.handles is not None and m.state != "loading"]
        total = sum(m.handles.info.weights_bytes for m in resident if m.handles is not None)
        for m in resident:
            if m.handles is not None:
                m.handles.bill_other_models(total - m.handles.info.weights_bytes)

    async def _expire_idle(self) -> None:
        """--model-ttl: a member idle that long leaves."""
        while True:
            now = trio.current_time()
            next_at = math.inf
            for member in list(self.members.values()):
                if member.state != "loaded":
                    continue
                if member.busy():  # (its end may come with no word: a request refused on its way in)
                    next_at = min(next_at, now + min(self.ttl_s, 1.0))
                    continue
                due = member.last_used + self.ttl_s
                if due <= now:
                    self.counters.expirations += 1
                    self._ask_leave(member, f"idle for {self.ttl_s:g} s")
                else:
                    next_at = min(next_at, due)
            changed = self._changed
            with trio.move_on_at(next_at):
                await changed.wait()

    # -- shutdown (the root's gate over every member)

    @property
    def in_flight(self) -> int:
        return sum(m.handles.admission.in_flight for m in self.members.values() if m.handles is not None)

    def close(self, *, cutoff_after: float) -> None:
        """Stop loading and admitting; requests running `cutoff_after` seconds from now are cut."""
        self.closed = True
        self.cutoff = trio.current_time() + cutoff_after
        handles = [m.handles for m in self.members.values() if m.handles is not None]
        for h in {id(h): h for h in [*handles, *([self._app_handles] if self._app_handles else [])]}.values():
            h.admission.close(cutoff_after=cutoff_after)  # (the app's too: /health says "shutting down")
        self._poke()

    async def wait_idle(self) -> None:
        while self.in_flight:
            for member in list(self.members.values()):
                if member.handles is not None:
                    await member.handles.admission.wait_idle()

    async def shutdown_flush(self, *, timeout: float) -> FlushResult | None:
        """Flush every member's SSD tier (None when no member has one)."""
        tiers = [m.handles.ssd for m in self.members.values() if m.handles is not None and m.handles.ssd is not None]
        if not tiers:
            return None
        results: list[FlushResult] = []

        async def flush(tier: SsdView) -> None:
            results.append(await shutdown_flush(tier, timeout=timeout))

        async with trio.open_nursery() as nursery:  # (side by side: one budget for all of them)
            for tier in tiers:
                nursery.start_soon(flush, tier)
        return FlushResult(durable=len(results) == len(tiers) and all(r.durable for r in results))


def _weights_estimate(path: Path) -> int:
    """What a model's weights take once loaded, from its safetensors files' sizes."""
    try:
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except OSError:
        return 0
