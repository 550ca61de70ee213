"""api/http/connection.py on the app's ASGI side, with virtual time: an early answer drains its body or
closes the connection, and hypercorn's end-of-response bookkeeping survives quart-trio's cancel.

`FakeHypercorn` plays hypercorn's part of one request: it feeds body messages and, like
hypercorn's H11Protocol, finishes the cycle inside the app's last `send` (it tells the app
`http.disconnect`, then needs further checkpoints before the connection is recycled).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from quart import request
from quart_trio import QuartTrio

from api.http.connection import DRAIN_SECONDS, RequestBody, drain_limit, with_connection_close
from api.http.protocol_errors import protocol_error, reason_phrase, request_path
from api.http.security import SecurityOptions, install_security

CAP = 1000


class FakeHypercorn:
    def __init__(self) -> None:
        self.to_app, self.app_inbox = trio.open_memory_channel[dict[str, Any]](10)
        self.messages: list[dict[str, Any]] = []
        self.started = trio.Event()
        self.started_at: float | None = None
        self.recycled = False

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.start":
            self.started_at = trio.current_time()
            self.started.set()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await self.to_app.send({"type": "http.disconnect"})  # hypercorn's _close_stream
            await trio.sleep(0)  # the rest of _maybe_recycle: next cycle, idle timer, or close
            await trio.sleep(0)
            self.recycled = True

    async def body(self, data: bytes, more: bool = False) -> None:
        await self.to_app.send({"type": "http.request", "body": data, "more_body": more})

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))


def scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        # A served Host and a JSON body type, so api/http/cross_site.py lets the request through.
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "extensions": {},
    }


def make_app(**options: Any) -> QuartTrio:
    app = QuartTrio(__name__)
    install_security(app, SecurityOptions(max_body_bytes=CAP, **options))

    @app.get("/quick")
    async def quick() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/v1/read")
    async def read() -> dict[str, int]:
        return {"bytes": len(await request.get_data())}

    return app


def length(n: int) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(n).encode())]


async def test_the_end_of_a_response_survives_quart_trio_cancelling_its_nursery(autojump_clock):
    server = FakeHypercorn()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(make_app(), scope("GET", "/quick", []), server.app_inbox.receive, server.send)
        await server.body(b"")
    assert server.status == 200
    assert server.recycled  # without the shield the recycle dies at its first checkpoint


async def test_an_early_answer_waits_for_its_body_and_keeps_the_connection(autojump_clock):
    server = FakeHypercorn()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(make_app(), scope("POST", "/nope", length(8)), server.app_inbox.receive, server.send)
        await trio.sleep(DRAIN_SECONDS / 2)
        assert not server.started.is_set()  # the 404 is ready but the body is still coming
        await server.body(b'{"a": 1}')
    assert server.status == 404 and b"connection" not in server.headers
    assert server.started_at == pytest.approx(DRAIN_SECONDS / 2)
    assert server.recycled


async def test_an_early_answer_whose_body_never_comes_closes_after_the_drain_time(autojump_clock):
    server = FakeHypercorn()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(make_app(), scope("POST", "/nope", length(8)), server.app_inbox.receive, server.send)
        await server.started.wait()
        nursery.cancel_scope.cancel()
    assert server.status == 404 and server.headers[b"connection"] == b"close"
    assert server.started_at == pytest.approx(DRAIN_SECONDS)


async def test_a_declared_body_past_the_drain_bound_is_answered_and_closed_at_once(autojump_clock):
    server = FakeHypercorn()
    headers = length(drain_limit(CAP) + 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(make_app(), scope("POST", "/v1/read", headers), server.app_inbox.receive, server.send)
        await server.started.wait()
        nursery.cancel_scope.cancel()
    assert server.status == 413 and server.headers[b"connection"] == b"close"
    assert server.json()["error"]["code"] == "request_too_large"
    assert server.started_at == 0


async def test_a_chunked_body_that_outgrows_the_drain_bound_stops_the_wait(autojump_clock):
    server = FakeHypercorn()
    headers = [(b"transfer-encoding", b"chunked")]
    async with trio.open_nursery() as nursery:
        app = make_app(api_key="k")
        nursery.start_soon(app, scope("POST", "/v1/read", headers), server.app_inbox.receive, server.send)
        await trio.sleep(0.1)
        assert not server.started.is_set()
        for _ in range(drain_limit(CAP) // 500 + 1):
            await server.body(b"x" * 500, more=True)
        await server.started.wait()
        nursery.cancel_scope.cancel()
    assert server.status == 401 and server.headers[b"connection"] == b"close"
    assert server.started_at == pytest.approx(0.1)


async def test_a_body_timeout_is_a_408_in_the_api_shape_and_closes_at_once(autojump_clock):
    server = FakeHypercorn()
    app = make_app()
    app.config["BODY_TIMEOUT"] = 3
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope("POST", "/v1/read", length(10)), server.app_inbox.receive, server.send)
        await server.body(b"12345", more=True)
        await server.started.wait()
        nursery.cancel_scope.cancel()
    assert server.status == 408 and server.headers[b"connection"] == b"close"
    assert server.json()["error"]["code"] == "request_timeout"
    assert server.started_at == pytest.approx(3)  # no drain wait on top of the body timeout


async def test_a_read_body_is_answered_without_waiting_or_closing(autojump_clock):
    server = FakeHypercorn()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(make_app(), scope("POST", "/v1/read", length(4)), server.app_inbox.receive, server.send)
        await server.body(b"abcd")
    assert server.status == 200 and server.json() == {"bytes": 4}
    assert b"connection" not in server.headers and server.started_at == 0


# --- pure pieces -----------------------------------------------------------------------------


def test_request_body_expectations():
    assert RequestBody(scope("GET", "/", []), 10).ended.is_set()
    assert RequestBody(scope("POST", "/", length(0)), 10).ended.is_set()
    assert not RequestBody(scope("POST", "/", length(5)), 10).ended.is_set()
    assert RequestBody(scope("POST", "/", length(11)), 10).too_big.is_set()
    chunked = RequestBody(scope("POST", "/", [(b"transfer-encoding", b"chunked")]), 10)
    assert not chunked.ended.is_set() and not chunked.too_big.is_set()
    assert drain_limit(None) > 0 and drain_limit(CAP) >= CAP


def test_connection_close_replaces_any_connection_header():
    start = {"type": "http.response.start", "status": 200, "headers": [(b"connection", b"keep-alive"), (b"a", b"b")]}
    assert with_connection_close(start)["headers"] == [(b"a", b"b"), (b"connection", b"close")]  # type: ignore[typeddict-item]


def test_the_path_of_a_request_line():
    assert request_path(b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: x") == "/v1/messages"
    assert request_path(b"GET /health HTTP/1.1") == "/health"
    assert request_path(b"GET") == "" and request_path(b"garbage bytes") == ""


def test_protocol_errors_name_their_limit():
    error = protocol_error(431, 16384)
    assert error.status == 431 and "16384" in error.message and error.code == "request_header_fields_too_large"
    assert protocol_error(400, 1).code == "bad_http_request" and protocol_error(505, 1).status == 505
    assert reason_phrase(431) == b"Request Header Fields Too Large" and reason_phrase(599) == b""
