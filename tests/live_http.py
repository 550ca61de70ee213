"""A real server on a real socket (hypercorn on port 0) in a background thread, for SDK tests.

`serve_in_thread(model_dir, ...)` runs `actors.root.run_server` with a real `GpuWorker` (or the
worker given) under its own `trio.run`, yields the base URL once it listens, and on exit asks it
to shut down the way SIGINT does and waits for the thread to end.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from actors.options import options as serve_options
from actors.root import run_server
from actors.shutdown import Shutdown
from model.text.tokenizer import Tokenizer
from tests.helpers.workers import gpu_worker

SHUTDOWN_TIMEOUT_S = 5


@contextmanager
def serve_in_thread(
    model_dir: Path, *, worker: Any = None, prompt_cache_bytes: int = 64 << 20, **config: Any
) -> Iterator[str]:
    ready: queue.Queue = queue.Queue()
    shutdown = Shutdown()
    trio_token: list[trio.lowlevel.TrioToken] = []
    if worker is None:
        worker = gpu_worker(model_dir, prompt_cache_gb=prompt_cache_bytes / 2**30)

    async def serve_http(app: Any, shutdown_trigger: Any) -> None:
        from hypercorn.config import Config
        from hypercorn.trio import serve

        hc = Config()
        hc.bind = ["127.0.0.1:0"]  # the OS picks the port
        hc.graceful_timeout = SHUTDOWN_TIMEOUT_S
        hc.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, app, hc, shutdown_trigger=shutdown_trigger))
            await app.served.wait()  # bound before the model loads (503 "loading" until then)
            ready.put(binds[0])

    async def main() -> None:
        trio_token.append(trio.lowlevel.current_trio_token())
        await run_server(
            worker,
            options=serve_options(model=str(model_dir), shutdown_timeout=SHUTDOWN_TIMEOUT_S, **config),
            make_tokenizer=lambda info: Tokenizer.from_dir(model_dir, eos_token_ids_from_config=info.eos_token_ids),
            serve_http=serve_http,
            shutdown=shutdown,
        )

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # surfaced to the test instead of dying silently
            ready.put(exc)

    thread = threading.Thread(target=thread_main, name=f"server-{model_dir.name}", daemon=True)
    thread.start()
    got = ready.get(timeout=240)
    if isinstance(got, BaseException):
        raise got
    try:
        yield got
    finally:
        try:
            trio.from_thread.run_sync(shutdown.request, trio_token=trio_token[0])
        except trio.RunFinishedError:
            pass
        thread.join(timeout=60)
        assert not thread.is_alive(), "server did not shut down"
