"""The GPU worker of a model whose engine runs in a process of its own (`--isolate`).

`IsolatedWorker` is the `Worker` (actors/worker_api.py) the scheduler drives, in the server; the
model, its caches and its MLX thread live in an engine process (actors/isolate/child.py) that it
starts, talks to over a socket pair (actors/isolate/link.py, plain data only), restarts and
stops. The composition root picks it instead of `GpuWorker` under `--isolate`; a model pool
(actors/pool.py) gets one per resident model, so each model's engine dies alone.

Inbound: the worker calls (each a call over the link; `abort` a message that never waits), and
`run`'s cancellation (shutdown). Outbound: each call's answer; `on_lost(error)` (the scheduler's
`worker_lost`) when an engine dies, so every row it held fails at once.

When the engine dies (kill -9, a segfault, the OOM killer): the calls in flight raise
`EngineLost` (503) at once, `on_lost` fails every row the dead engine held (a stream ends with
an error event in its protocol's shape), the cause and exit status are logged, and a new engine
starts after a backoff (`RestartPolicy`). Calls made meanwhile wait for it: a queued request
opens its row on the new engine, and an `open_row` the death interrupted is made again once (the
row never opened there). The adapters that were mounted are mounted again. An engine that keeps
dying (more than `max_restarts` deaths, none after `stable_s` of serving) leaves the model failed:
every call raises `EngineFailed` (503), /health says "degraded", /v1/models marks it failed.

Shutdown: cancelling `run` tells the engine to stop (it drains: its SSD tier's shutdown flush is
the root's `shutdown_flush` call before that) and waits `STOP_TIMEOUT_S` for it to exit, then
kills it. An engine whose server died sees its socket close and exits by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from actors.isolate.link import Link
from actors.isolate.process import EngineProcess, Launch, describe_exit, spawn_engine
from actors.isolate.protocol import EngineError, EngineFailed, EngineLost
from actors.isolate.remote import STATS_S, RemoteCacheStats, RemoteSsdTier, RemoteTimes
from actors.mlx_thread import WorkerDied
from actors.worker_api import AdapterReport, ModelInfo
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.load.errors import ModelLoadError
from model.options import AccessOptions, ServerOptions

if TYPE_CHECKING:
    from model.engine.machine import MachineFacts
    from model.engine.scoring import PromptScore

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # a stopped engine exits within this (its drain included), or is killed
REAP_S = 5.0  # after its socket closed, the engine's exit status comes within this, or it is killed
State = Literal["starting", "serving", "restarting", "failed", "stopped"]


@attrs.frozen
class RestartPolicy:
    """Restarts after the engine dies: the k-th in a row waits `backoff_s * 2**(k-1)` (at most
    `max_backoff_s`); after `max_restarts` in a row the model is failed. A death after `stable_s`
    of serving starts the count again."""

    max_restarts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    stable_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


@attrs.define(eq=False)
class _Engine:
    """One engine process and its link; `gen` numbers the engines a worker started."""

    process: EngineProcess
    link: Link
    gen: int
    hello: dict[str, Any] | None = None
    fatal: dict[str, Any] | None = None
    answered: trio.Event = attrs.Factory(trio.Event)  # hello, fatal, or the link closed
    started_at: float = 0.0

    def on_message(self, head: dict[str, Any]) -> None:
        if "hello" in head:
            self.hello = head
        elif "fatal" in head:
            self.fatal = head
        else:
            log.warning("unexpected message from the engine: %s", sorted(head))
            return
        self.answered.set()


class IsolatedWorker:
    def __init__(
        self,
        model_dir: Path | str,
        options: ServerOptions,
        *,
        name: str | None = None,
        launch: Launch = spawn_engine,
        policy: RestartPolicy = RestartPolicy(),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.options = options
        self.name = name
        self.policy = policy
        self.info: ModelInfo | None = None
        self.on_lost: Callable[[Exception], None] | None = None
        self.state: State = "starting"
        self.failure: str | None = None  # why the model failed (state "failed")
        self.restarts = 0
        self.times = RemoteTimes(self)
        self.prompt_cache: RemoteCacheStats | None = None  # (known from the first engine's hello)
        self.ssd_tier: RemoteSsdTier | None = None
        self._launch = launch
        self._engine: _Engine | None = None
        self._gens = 0
        self._changed = trio.Event()
        self._rows: dict[int, int] = {}  # an open row's id -> the engine generation it opened on
        self._mounted: dict[str, str] = {}  # adapter id -> path: mounted again on a new engine
        self._other_weights: int | None = None
        self._stats: dict[str, Any] = {}
        self._nursery: trio.Nursery | None = None

    @property
    def alive(self) -> bool:
        return self.state == "serving"

    @property
    def label(self) -> str:
        return self.name or self.model_dir.name

    @property
    def prefill_chunk(self) -> int:
        return self.options.engine.prefill_chunk

    # -- the actor

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine (its load's failure is raised: start-up fails), serve, restart it when
        it dies, stop it when cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                engine = await self._start()
                assert engine.hello is not None
                self.info = engine.hello["hello"]
                if engine.hello.get("prompt_cache"):
                    self.prompt_cache = RemoteCacheStats(self)
                if engine.hello.get("ssd"):
                    self.ssd_tier = RemoteSsdTier(self)
                assert self.info is not None
                task_status.started(self.info)
                nursery.start_soon(self._refresh_stats)
                await self._supervise()
                await trio.sleep_forever()  # failed: every call answers 503 until shutdown
            finally:
                self._set_state("stopped")
                with trio.CancelScope(shield=True):
                    await self._stop()  # (closes the links, whose tasks outlive cancellation)
                nursery.cancel_scope.cancel()

    async def _start(self) -> _Engine:
        """A new engine, serving (its model loaded, adapters mounted again); raises when it cannot."""
        assert self._nursery is not None
        process = await self._launch()
        self._gens += 1
        engine = _Engine(process, Link(process.stream, sock=process.sock), self._gens)
        engine.link.on_message = engine.on_message
        try:
            await self._nursery.start(engine.link.run)
            self._nursery.start_soon(_set_when, engine.answered, engine.link.closed)
            # (the keys stay here: the engine serves no HTTP)
            options = attrs.evolve(self.options, access=AccessOptions())
            engine.link.post({"setup": {"model_dir": str(self.model_dir), "name": self.name, "options": options}})
            await engine.answered.wait()
            if engine.hello is None:
                raise await self._load_failure(engine)
            for adapter_id, path in self._mounted.items():
                try:
                    await engine.link.call("mount_adapter", adapter_id, path)
                except Exception as exc:  # noqa: BLE001 - its requests get 400s from the registry's check
                    log.error("model %s: adapter %s did not mount again: %s", self.label, adapter_id, exc)
            if self._other_weights is not None:
                await engine.link.call("set_other_weights", self._other_weights)
        except BaseException:
            engine.link.close("start-up failed")
            if engine.fatal is None:  # (cancelled, or a mount failed: it would only exit on EOF)
                engine.process.kill()
            with trio.CancelScope(shield=True):
                await self._reap(engine)
            raise
        engine.started_at = trio.current_time()
        self._engine = engine
        self._set_state("serving")
        log.info("model %s: engine process %s serving (engine %d)", self.label, process.pid, engine.gen)
        return engine

    async def _load_failure(self, engine: _Engine) -> Exception:
        if engine.fatal is not None:
            message = str(engine.fatal.get("fatal"))
            await self._reap(engine)
            return ModelLoadError(message) if engine.fatal.get("usage") else EngineError(message)
        code = await self._reap(engine)
        return EngineError(f"the engine process ended before it loaded the model ({describe_exit(code)})")

    async def _reap(self, engine: _Engine) -> int | None:
        """The engine's exit status, killing it when it does not exit within `REAP_S`."""
        with trio.move_on_after(REAP_S):
            return await engine.process.wait()
        engine.process.kill()
        with trio.move_on_after(REAP_S):
            return await engine.process.wait()
        return None

    async def _supervise(self) -> None:
        """Restart the engine each time it dies; return once the model has failed."""
        deaths = 0
        while True:
            engine = self._engine
            assert engine is not None
            await engine.link.closed.wait()
            served = trio.current_time() - engine.started_at
            self._set_state("restarting")
            code = await self._reap(engine)
            cause = f"the engine process (pid {engine.process.pid}) died: {describe_exit(code)}"
            log.error("model %s: %s; the requests it was generating fail", self.label, cause)
            if self.on_lost is not None:
                self.on_lost(EngineLost(f"the model's engine process died ({describe_exit(code)})"))
            deaths = 1 if served >= self.policy.stable_s else deaths + 1
            while True:
                if deaths > self.policy.max_restarts:
                    self.failure = f"{cause}; gave up after {self.policy.max_restarts} restarts"
                    log.error("model %s failed: %s", self.label, self.failure)
                    self._set_state("failed")
                    return
                delay = self.policy.delay(deaths)
                log.warning(
                    "model %s: restarting its engine in %.1f s (restart %d of at most %d in a row)",
                    self.label,
                    delay,
                    deaths,
                    self.policy.max_restarts,
                )
                await trio.sleep(delay)
                try:
                    await self._start()
                except Exception as exc:  # noqa: BLE001 - a failed restart counts as one more death
                    cause = f"the restarted engine did not load: {exc}"
                    log.error("model %s: %s", self.label, cause)
                    deaths += 1
                    continue
                self.restarts += 1
                break

    async def _stop(self) -> None:
        engine = self._engine
        if engine is None or engine.link.closed.is_set():
            if engine is not None:
                await self._reap(engine)
            return
        engine.link.post({"stop": True})
        with trio.move_on_after(STOP_TIMEOUT_S):
            code = await engine.process.wait()
            log.info("model %s: engine process %s stopped (%s)", self.label, engine.process.pid, describe_exit(code))
            engine.link.close("stopped")
            return
        log.warning("model %s: its engine did not stop within %.0f s: killing it", self.label, STOP_TIMEOUT_S)
        engine.link.close("stopped")
        engine.process.kill()
        await self._reap(engine)

    def _set_state(self, state: State) -> None:
        self.state = state
        self._changed.set()
        self._changed = trio.Event()

    async def _serving(self) -> _Engine:
        """The engine, once one serves (waiting through a restart)."""
        while True:
            engine = self._engine
            if self.state == "serving" and engine is not None and not engine.link.closed.is_set():
                return engine
            if self.state == "failed":
                raise EngineFailed(f"the model {self.label} failed: {self.failure}")
            if self.state == "stopped":
                raise WorkerDied("the model's engine has stopped")
            await self._changed.wait()

    def _lost(self, row_ids: list[int] | tuple[int, ...]) -> bool:
        """Whether any of these rows was open on an engine that is gone."""
        engine = self._engine
        for row_id in row_ids:
            gen = self._rows.get(row_id)
            if gen is not None and (engine is None or gen != engine.gen or engine.link.closed.is_set()):
                return True
        return False

    async def _call(self, method: str, *args: Any, rows: tuple[int, ...] = (), retry: bool = False, **kw: Any) -> Any:
        """`method` on the serving engine, with the generation that answered: (value, gen)."""
        while True:
            if self._lost(rows):
                raise EngineLost("the model's engine process died; this request's rows were on it")
            engine = await self._serving()
            try:
                return await engine.link.call(method, *args, **kw), engine.gen
            except EngineLost:
                if not retry:
                    raise EngineLost("the model's engine process died during the call") from None
                retry = False

    async def host_call(self, method: str, **kwargs: Any) -> Any:
        value, _ = await self._call(method, **kwargs)
        return value

    def stats_block(self, name: str) -> dict[str, Any] | None:
        block = self._stats.get(name)
        return block if isinstance(block, dict) else None

    def keep_stats(self, name: str, block: dict[str, Any]) -> None:
        self._stats[name] = block

    async def _refresh_stats(self) -> None:
        while True:
            engine = self._engine
            if self.state == "serving" and engine is not None:
                try:
                    self._stats = dict(await engine.link.call("stats"))
                except Exception:  # noqa: BLE001 - gone meanwhile: the next engine answers
                    pass
            await trio.sleep(STATS_S)

    # -- the Worker interface (actors/worker_api.py) -------------------------------------------

    async def open_row(self, spec: RowSpec) -> RowOpened:
        # (an engine that died during it never held the row: it opens on the next one)
        opened, gen = await self._call("open_row", spec, retry=True)
        self._rows[spec.row_id] = gen
        result: RowOpened = opened
        return result

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        value, _ = await self._call("prefill", row_id, max_tokens, rows=(row_id,))
        result: PrefillProgress = value
        return result

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]:
        value, _ = await self._call("prefill_group", list(row_ids), rows=tuple(row_ids))
        return list(value)

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]:
        value, gen = await self._call("fork_rows", source_id, list(specs), rows=(source_id,))
        for spec in specs:
            self._rows[spec.row_id] = gen
        return list(value)

    async def join(self, row_id: int) -> TokenOut:
        value, _ = await self._call("join", row_id, rows=(row_id,))
        result: TokenOut = value
        return result

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]:
        value, _ = await self._call("join_group", list(row_ids), rows=tuple(row_ids))
        return list(value)

    async def step(self) -> list[TokenOut]:
        value, _ = await self._call("step", rows=tuple(self._rows))  # (a lost row was in the batch)
        return list(value)

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        if self._lost((row_id,)):
            self._rows.pop(row_id, None)
            return  # its engine is gone, and its KV with it
        self._rows.pop(row_id, None)
        try:
            await self._call("close_row", row_id, reusable=reusable, retain_s=retain_s)
        except EngineLost:
            pass  # (died meanwhile: nothing left to close)

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        value, _ = await self._call("mount_adapter", adapter_id, path)
        self._mounted[adapter_id] = path
        report: AdapterReport = value
        return report

    async def unmount_adapter(self, adapter_id: str) -> bool:
        value, _ = await self._call("unmount_adapter", adapter_id)
        self._mounted.pop(adapter_id, None)  # (gone now or once its rows end: never mounted again)
        return bool(value)

    async def embed(self, inputs: list[list[int]], *, dimensions: int | None = None) -> list[list[float]]:
        value, _ = await self._call("embed", [list(t) for t in inputs], dimensions=dimensions)
        return list(value)

    async def score(self, tokens: list[int], *, top: int = 0, adapters: tuple[str, ...] = ()) -> list[PromptScore]:
        value, _ = await self._call("score", list(tokens), top=top, adapters=tuple(adapters))
        return list(value)

    async def machine(self) -> MachineFacts:
        value, _ = await self._call("machine")
        facts: MachineFacts = value
        return facts

    def abort(self, row_id: int) -> None:
        engine = self._engine
        if engine is not None and self._rows.get(row_id) == engine.gen:
            engine.link.post({"abort": row_id})

    def set_other_weights(self, nbytes: int) -> None:
        """A model pool's other residents' weights (actors/pool.py): told to the engine now and
        to every engine started later."""
        self._other_weights = nbytes
        engine = self._engine
        if self.state == "serving" and engine is not None:
            engine.link.post({"c": 0, "m": "set_other_weights", "a": [nbytes], "k": {}})  # (its answer is dropped)


async def _set_when(event: trio.Event, cause: trio.Event) -> None:
    await cause.wait()
    event.set()
