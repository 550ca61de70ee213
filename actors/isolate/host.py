"""The engine process's side of isolation: load the worker, then run the server's calls on it.

Inbound (the link, actors/isolate/link.py): calls (`protocol.CALLS`; each runs as a task of its
own, so an embedding job or a /stats read never waits behind a decode step on the trio side: the
GPU worker still runs its jobs one at a time on its MLX thread), aborts (`Worker.abort`, at
once, even while a prefill of that row runs) and `stop`. Outbound: the hello once loaded (or the fatal error
that stops the load), then each call's answer.

A row call (`protocol.ROW_CALLS`: one job each, whose result is the answer) is answered from the
MLX thread the moment its job ends (actors/mlx_thread.py `ON_THREAD`), not after this process's
event loop wakes for it: at one stream, that wake-up was on the path of every token. A worker
without an MLX thread (tests' fakes) answers from the call's task, as every other call does.

With `--ssd-cache` the SSD tier's actors (actors/ssd/) run here beside the worker, so prompt-cache
snapshots never cross the socket: the server asks for a flush, a shutdown flush or a drain, and
reads the tier's /stats block through `stats`. Background SSD work yields while rows are open.

`serve_engine` returns the process's exit code: 0 after `stop`, 1 when the server went away (EOF:
the process exits without waiting to be told), 2 when the model could not load for a reason in
the command line (the server's start-up then exits 2 too).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, Protocol

import outcome
import trio

from actors.isolate.codec import CodecError
from actors.isolate.link import Link
from actors.isolate.protocol import CALLS, ROW_CALLS, WORKER_CALLS, error_fields
from actors.mlx_thread import ON_THREAD
from actors.ssd.drain import drain_to_ssd
from actors.ssd.durability import SsdTier, shutdown_flush, start_ssd_tier
from actors.startup import find
from actors.worker_api import ModelInfo, Worker
from cache.ssd_store import SsdUnavailable
from model.load.errors import ModelLoadError
from model.options import ServerOptions

log = logging.getLogger(__name__)


class HostedWorker(Worker, Protocol):
    """A worker the engine process serves (actors/gpu_worker.py `GpuWorker`; tests' fakes)."""

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = ...) -> None: ...


class EngineHost:
    def __init__(self, worker: HostedWorker, link: Link, nursery: trio.Nursery) -> None:
        self.worker = worker
        self.link = link
        self.ssd: SsdTier | None = None
        self.stopped = trio.Event()
        self._nursery = nursery
        self._open_rows: set[int] = set()  # (background SSD work waits while any is open)

    @property
    def busy(self) -> bool:
        return bool(self._open_rows)

    async def serve(self, options: ServerOptions) -> int:
        """Load, start the SSD tier, say hello, serve until `stop`: 0, or 1/2 when the load failed
        (2: the model directory's or the command line's fault)."""
        try:
            info = await self._nursery.start(self.worker.run)
        except Exception as exc:
            usage = find(exc, (ModelLoadError, SsdUnavailable)) is not None
            leaf = find(exc, Exception) or exc
            log.debug("the engine could not load: %s", leaf, exc_info=exc)  # (the server says it, in one line)
            self.link.post({"fatal": str(leaf), "usage": usage})
            return 2 if usage else 1
        caches = options.caches
        self.ssd = await start_ssd_tier(
            self._nursery,
            self.worker,
            busy=lambda: self.busy,
            spill_queue_bytes=int(caches.ssd_spill_queue_gb * 2**30),
            demote_idle_s=caches.ssd_demote_idle_s,
        )
        prompt_cache = getattr(self.worker, "prompt_cache", None) is not None
        self.link.post({"hello": info, "prompt_cache": prompt_cache, "ssd": self.ssd is not None})
        await self.stopped.wait()
        return 0

    def on_message(self, head: dict[str, Any]) -> None:
        if "abort" in head:
            self.worker.abort(int(head["abort"]))
        elif "stop" in head:
            self.stopped.set()
        elif "setup" in head:
            pass  # (child.py read it to build the worker: an in-process engine is handed one)
        elif "c" in head:
            self._nursery.start_soon(self._answer, head["c"], str(head.get("m")), head.get("a") or [], head.get("k"))
        else:
            log.warning("unexpected message from the server: %s", sorted(head))

    async def _answer(self, call_id: int, method: str, args: list[Any], kwargs: dict[str, Any] | None) -> None:
        answered: list[bool] = []  # (the MLX thread answered it)
        if method in ROW_CALLS:

            def on_thread(result: outcome.Outcome) -> None:
                if isinstance(result, outcome.Error):
                    head = {"r": call_id, "e": error_fields(result.error)}
                else:
                    value = result.unwrap()
                    self._track(method, args, value)  # (before the server can make its next call)
                    head = {"r": call_id, "v": value}
                try:
                    self.link.post_from_thread(head)
                except CodecError:
                    return  # (the task's own post says so: the same error, as any call's)
                answered.append(True)

            ON_THREAD.set(on_thread)  # (this task's calls only)
        try:
            if method not in CALLS:
                raise ValueError(f"{method!r} is not a call the engine process takes")
            value = await self._run(method, args, kwargs or {}, answered)
        except Exception as exc:  # noqa: BLE001 - the caller's exception, raised on its side
            if not answered:
                self.link.post({"r": call_id, "e": error_fields(exc)})
        else:
            if not answered:
                self.link.post({"r": call_id, "v": value})

    async def _run(self, method: str, args: list[Any], kwargs: dict[str, Any], answered: list[bool]) -> Any:
        if method in WORKER_CALLS:
            call = getattr(self.worker, method, None)
            if call is None:
                raise ValueError(f"this engine has no {method!r}")
            value = await call(*args, **kwargs)
            if not answered:  # (else tracked on the MLX thread)
                self._track(method, args, value)
            return value
        if method == "stats":
            return self.stats()
        if method == "set_other_weights":
            setter = getattr(self.worker, "set_other_weights", None)
            if setter is not None:
                setter(int(args[0]))
            return None
        return await self._ssd_call(method, args, kwargs)

    def _track(self, method: str, args: list[Any], value: Any) -> None:
        if method == "open_row":
            self._open_rows.add(value.row_id)
        elif method == "fork_rows":
            self._open_rows.update(opened.row_id for opened in value)
        elif method == "close_row":
            self._open_rows.discard(int(args[0]))

    async def _ssd_call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.ssd is None:
            raise ValueError("this engine has no SSD tier")
        if method == "ssd_flush":
            return {"result": await self.ssd.flush(), "stats": self.ssd.stats()}
        if method == "ssd_shutdown_flush":
            result = await shutdown_flush(self.ssd, timeout=float(kwargs["timeout"]))
            return {"result": result, "stats": self.ssd.stats()}
        if method == "ssd_drain":
            report = await drain_to_ssd(self.ssd, self.worker)
            return {"report": report, "stats": self.ssd.stats()}
        raise ValueError(f"{method!r} is not a call the engine process takes")

    def stats(self) -> dict[str, Any]:
        """The /stats blocks the server shows for this engine (read here, on the trio thread, as
        in one process: plain ints the MLX thread writes)."""
        times = getattr(self.worker, "times", None)
        cache = getattr(self.worker, "prompt_cache", None)
        return {
            "times": None if times is None else times.snapshot(),
            "prompt_cache": None if cache is None else cache.stats(),
            "ssd": None if self.ssd is None else self.ssd.stats(),
        }


async def serve_engine(
    stream: trio.abc.Stream,
    worker: HostedWorker,
    options: ServerOptions,
    on_lost: Callable[[], None] = lambda: None,
    sock: socket.socket | None = None,
) -> int:
    """Load `worker`, say hello over `stream` (`sock`: its socket), answer calls until `stop` or
    EOF; the exit code. `on_lost` runs the moment the server's end closes (the process arms its
    exit deadline)."""
    link = Link(stream, sock=sock)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        host = EngineHost(worker, link, nursery)
        link.on_message = host.on_message
        code = 1  # (the server's end closed before the load ended)
        with trio.CancelScope() as serving:

            async def watch() -> None:
                await link.closed.wait()
                on_lost()
                serving.cancel()

            nursery.start_soon(watch)
            code = await host.serve(options)
        if link.closed.is_set() and not host.stopped.is_set():
            log.error("the server closed the engine's socket (%s): exiting", link.why)
            code = 1
        with trio.move_on_after(5.0):  # (the answers and the fatal error go out before the socket closes)
            await link.flush()
        link.close("the engine stopped")
        nursery.cancel_scope.cancel()
    return code
