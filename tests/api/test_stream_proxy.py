"""Streams a reverse proxy passes through at once: no-buffering headers on every protocol's SSE,
keep-alive comments during a long prefill, and still no byte before a queued row opens."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.http.wire import KEEPALIVE_FRAME, KEEPALIVE_INTERVAL_S
from tests.fakes import FakeTokenizer, FakeWorker

LONG = "x" * 40  # ~13 prefill chunks of 4 tokens: ~39 s of prefill at 3 s a chunk
STREAMS = {
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
    "/v1/completions": lambda text: {"prompt": text, "max_tokens": 2},
    "/v1/responses": lambda text: {"input": text, "max_output_tokens": 2},
    "/v1/messages": lambda text: {
        "model": "fake-model",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": text}],
    },
}


@asynccontextmanager
async def server(worker: FakeWorker, **config):
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


def frames(body: bytes) -> list[bytes]:
    return [frame + b"\n\n" for frame in body.split(b"\n\n") if frame]


@pytest.mark.parametrize("path", sorted(STREAMS))
async def test_every_stream_asks_proxies_not_to_buffer(autojump_clock, path):
    async with server(FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)) as client:
        response = await client.post(path, json={**STREAMS[path]("hi"), "stream": True})
        assert response.status_code == 200 and response.content_type == "text/event-stream"
        assert response.headers["X-Accel-Buffering"] == "no"
        assert response.headers["Cache-Control"] == "no-cache"


async def timed_stream(client, path: str, body: dict) -> tuple[float | None, list[tuple[float, bytes]]]:
    """(when the response started, [(when, bytes)] per write), in the server's virtual seconds
    from the moment the body was sent."""
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        sent_at = trio.current_time()
        writes: list[tuple[float, bytes]] = []
        started: float | None = None
        while True:
            try:
                data = await conn.receive()
            except trio.EndOfChannel:
                break
            if started is None and conn.status_code is not None:
                started = trio.current_time() - sent_at
            writes.append((trio.current_time() - sent_at, data))
    return started, writes


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_long_prefill_sends_keep_alive_comments(autojump_clock, path):
    worker = FakeWorker(chunk=4, prefill_cost=3.0, join_cost=0.1, step_cost=0.1)
    async with server(worker) as client:
        _, writes = await timed_stream(client, path, STREAMS[path](LONG))
    keep_alives = [i for i, (_, data) in enumerate(writes) if data == KEEPALIVE_FRAME]
    assert len(keep_alives) >= int(36 / KEEPALIVE_INTERVAL_S)  # one per quiet interval of the ~39 s prefill
    assert keep_alives == list(range(keep_alives[0], keep_alives[-1] + 1))  # one run: the prefill
    assert keep_alives[0] <= 1  # after the stream's opening frame at most: no token came before them
    gaps = [writes[b][0] - writes[a][0] for a, b in zip(keep_alives, keep_alives[1:])]
    assert all(gap == pytest.approx(KEEPALIVE_INTERVAL_S, abs=0.5) for gap in gaps)
    tail = b"".join(data for _, data in writes[keep_alives[-1] + 1 :])
    assert KEEPALIVE_FRAME not in tail  # tokens every 0.1 s: none once they flow
    last = frames(tail)[-1]
    assert last == b"data: [DONE]\n\n" or last.startswith((b"event: response.completed", b"event: response.incomplete"))


async def test_the_anthropic_stream_keeps_its_ping_events(autojump_clock):
    worker = FakeWorker(chunk=4, prefill_cost=3.0, join_cost=0.1, step_cost=0.1)
    async with server(worker) as client:
        _, writes = await timed_stream(client, "/v1/messages", STREAMS["/v1/messages"](LONG))
    body = b"".join(data for _, data in writes)
    assert KEEPALIVE_FRAME not in body and body.count(b"event: ping") >= 1 + int(36 / 5.0)


async def test_a_queued_request_sends_no_byte_before_its_row_opens(autojump_clock):
    # One row at a time: the second request waits out the first one's ~39 s prefill in the queue,
    # past several keep-alive intervals, with no response started (a 503 could still come).
    worker = FakeWorker(chunk=4, prefill_cost=3.0, join_cost=0.1, step_cost=0.1)
    async with server(worker, batch=1) as client:
        results: dict[str, tuple[float | None, list[tuple[float, bytes]]]] = {}

        async def first() -> None:
            results["first"] = await timed_stream(client, "/v1/chat/completions", STREAMS["/v1/chat/completions"](LONG))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.sleep(1.0)
            results["second"] = await timed_stream(
                client, "/v1/chat/completions", STREAMS["/v1/chat/completions"]("hi")
            )
    started, writes = results["second"]
    assert started is not None and started > 3 * KEEPALIVE_INTERVAL_S
    assert writes[0][0] == started  # the first byte is the response's start, after the row opened
