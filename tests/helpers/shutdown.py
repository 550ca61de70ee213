"""The shutdown tests' server double and their event order."""

from __future__ import annotations

import json
from functools import partial

import trio

from actors.options import options as serve_options
from actors.root import run_server
from actors.shutdown import Shutdown, ShutdownPlan
from tests.fakes import FakeTokenizer


def fake_http(clients, *, graceful, note):
    async def serve_http(app, shutdown_trigger):
        async def connect(run_client):
            await app.served.wait()  # the port is bound before the model loads: clients wait for it
            await run_client(app.app.test_client())

        async with trio.open_nursery() as connections:
            for run_client in clients:
                connections.start_soon(connect, run_client)
            await shutdown_trigger()
            note("listeners closed")
            connections.cancel_scope.deadline = trio.current_time() + graceful

    return serve_http


async def run(worker, clients, *, timeout, signals_at, ready=None, **options):
    """`ready`: the first signal waits (also) until it holds; translating and templating run on
    real threads, and the autojump clock jumps ahead while it waits for them."""
    events = []

    def note(what):
        events.append((trio.current_time(), what))

    async def flush():
        await trio.sleep(0.5)  # flush work is shielded from the root's cancellation
        note("flush")

    shutdown = Shutdown()
    config = serve_options(shutdown_timeout=timeout, **options)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                run_server,
                worker,
                options=config,
                make_tokenizer=lambda info: FakeTokenizer(),
                serve_http=fake_http(
                    [partial(c, note) for c in clients],
                    graceful=ShutdownPlan.for_options(config).http_deadline,
                    note=note,
                ),
                shutdown=shutdown,
                flush_hooks=[flush],
                trace=note,
            )
        )
        for at in signals_at:
            await trio.sleep_until(at)
            while ready is not None and not ready():
                await trio.sleep(0.05)
            note("signal")
            shutdown.request()
    note("returned")
    return events


def streamer(max_tokens):
    async def client(note, http):
        body = {"prompt": "a", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        response = await http.post("/v1/completions", json=body)
        frames = [f.removeprefix("data: ") for f in (await response.get_data()).decode().split("\n\n") if f]
        chunks = [json.loads(f) for f in frames[:-1]]
        reason = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"])
        usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
        note(("stream ended", frames[-1], reason, usage["completion_tokens"]))

    return client


def names(events):
    return [what if isinstance(what, str) else what[0] for _, what in events]


def order_is(events, *expected):
    seen = names(events)
    positions = [seen.index(name) for name in expected]
    return positions == sorted(positions)
