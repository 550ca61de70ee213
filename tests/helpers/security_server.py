"""The app with its security options over the fake worker, in-process."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker


@asynccontextmanager
async def server(worker: FakeWorker | None = None, **config):
    worker = worker or FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client(), handles
        nursery.cancel_scope.cancel()
