"""Isolated engines inside the test's own trio run: `IsolatedWorker` launches each over a memory
stream pair, its host (actors/isolate/host.py `serve_engine`) serving a fake worker, so the whole
protocol runs on MockClock time. `kill()` is kill -9: the engine's end of the stream closes and
its tasks are cancelled, with no last word."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import attrs
import trio
import trio.testing

from actors.isolate.host import HostedWorker, serve_engine
from actors.isolate.process import EngineProcess
from actors.isolate.worker import IsolatedWorker, RestartPolicy
from actors.options import options as serve_options
from model.options import ServerOptions
from tests.fakes import FakeWorker

KILLED = -9


class InProcessEngine:
    """One engine 'process': `serve_engine` over the far end of a memory stream pair."""

    def __init__(self, worker: HostedWorker, options: ServerOptions, nursery: trio.Nursery) -> None:
        ours, theirs = trio.testing.memory_stream_pair()
        self.stream: trio.abc.Stream = ours
        self.sock: socket.socket | None = None  # (a memory stream: every frame goes through the writer)
        self.pid: int | None = None
        self.worker = worker
        self.code: int | None = None
        self._theirs = theirs
        self._exited = trio.Event()
        self._scope = trio.CancelScope()
        nursery.start_soon(self._main, options)

    async def _main(self, options: ServerOptions) -> None:
        with self._scope:
            code = await serve_engine(self._theirs, self.worker, options)
            self.code = code if self.code is None else self.code
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.code is not None
        return self.code

    def kill(self) -> None:
        if self._exited.is_set():
            return
        self.code = KILLED
        self._theirs.send_stream.close()  # (the server reads EOF at once)
        self._theirs.receive_stream.close()
        self._scope.cancel()


@attrs.define
class Engines:
    """Every engine launched, in order; `make_worker()` builds each one's worker."""

    nursery: trio.Nursery
    make_worker: Callable[[], HostedWorker]
    options: ServerOptions
    started: list[InProcessEngine] = attrs.Factory(list)

    async def launch(self) -> EngineProcess:
        engine = InProcessEngine(self.make_worker(), self.options, self.nursery)
        self.started.append(engine)
        return engine

    @property
    def last(self) -> InProcessEngine:
        return self.started[-1]


def isolated(
    nursery: trio.Nursery,
    make_worker: Callable[[], HostedWorker] = lambda: FakeWorker(),
    *,
    policy: RestartPolicy = RestartPolicy(),
    **config: Any,
) -> tuple[IsolatedWorker, Engines]:
    """An IsolatedWorker whose engines run in `nursery`, each with a worker `make_worker()` builds."""
    options = serve_options(isolate=True, **config)
    engines = Engines(nursery, make_worker, options)
    worker = IsolatedWorker("/models/fake", options, name="fake-model", launch=engines.launch, policy=policy)
    return worker, engines
