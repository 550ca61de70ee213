"""The server behind a real TCP proxy on the same host: hypercorn on a real socket, a byte
forwarder in front of it (so every request reaches the server from 127.0.0.1, as through nginx
on the same machine), and httpx in front of that. The FakeWorker stands in for the model."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker

ADMIN = "admin-secret"
ADAPTER = {"id": "a", "path": "/adapters/a"}


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
        await sink.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _forward(upstream_port: int, client: trio.SocketStream) -> None:
    async with client, await trio.open_tcp_stream("127.0.0.1", upstream_port) as upstream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, upstream)
            nursery.start_soon(_pump, upstream, client)


@asynccontextmanager
async def proxied(**config: object) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose requests go through the forwarder to a real server with `config`."""
    worker = FakeWorker(prefill_cost=0.01, join_cost=0.01, step_cost=0.01)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        hc = Config()
        hc.bind = ["127.0.0.1:0"]
        hc.accesslog = None
        shutdown = trio.Event()
        binds = await nursery.start(partial(serve, create_app(handles), hc, shutdown_trigger=shutdown.wait))
        server_port = int(binds[0].rsplit(":", 1)[1])
        [listener] = await nursery.start(partial(trio.serve_tcp, partial(_forward, server_port), 0, host="127.0.0.1"))
        proxy_port = listener.socket.getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy_port}", timeout=10) as client:
            yield client
        shutdown.set()
        nursery.cancel_scope.cancel()


def logged_clients(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_trio.requests"]
    return [json.loads(line.removeprefix("request "))["client"] for line in lines]


async def test_with_a_token_admin_routes_need_it_through_the_proxy():
    with trio.fail_after(30):
        async with proxied(admin_token=ADMIN) as client:
            token = {"Authorization": f"Bearer {ADMIN}"}
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert (await client.post("/v1/adapters", json=ADAPTER, headers=headers)).status_code == 401
                assert (await client.delete("/v1/adapters/a", headers=headers)).status_code == 401
                response = await client.post("/admin/cache/flush", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_admin_token"
            assert (await client.post("/v1/adapters", json=ADAPTER, headers=token)).status_code == 200
            assert (await client.delete("/v1/adapters/a", headers=token)).status_code == 200
            assert (await client.post("/admin/cache/flush", headers=token)).status_code == 200


async def test_without_a_token_a_forwarded_request_is_not_local():
    with trio.fail_after(30):
        async with proxied() as client:
            for headers in ({"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=203.0.113.9"}):
                response = await client.post("/v1/adapters", json=ADAPTER, headers=headers)
                assert response.status_code == 403 and response.json()["error"]["code"] == "admin_forbidden"
                assert (await client.post("/admin/cache/flush", headers=headers)).status_code == 403
            # A proxy that adds no forwarding header cannot be told from a local client: that is why
            # docs/deploy.md sets --admin-token behind every proxy.
            assert (await client.post("/admin/cache/flush")).status_code == 200


async def test_browser_shaped_admin_writes_are_refused():
    # What a page on another site can make a browser on this host send: no token, no proxy header.
    with trio.fail_after(30):
        async with proxied() as client:
            text = await client.post(
                "/v1/adapters", content=json.dumps(ADAPTER), headers={"Content-Type": "text/plain;charset=UTF-8"}
            )
            assert text.status_code == 415 and text.json()["error"]["code"] == "unsupported_media_type"
            cross = await client.post("/v1/adapters", json=ADAPTER, headers={"Origin": "https://evil.example"})
            assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin_forbidden"
            cross = await client.post("/admin/cache/flush", headers={"Origin": "https://evil.example"})
            assert cross.status_code == 403
            rebound = await client.get("/v1/adapters", headers={"Host": "evil.example:8080"})
            assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
            assert (await client.get("/v1/adapters")).json()["data"] == []  # nothing was mounted


async def test_a_foreign_host_is_refused_and_an_allowed_one_served():
    with trio.fail_after(30):
        async with proxied(allowed_hosts=("chat.example",)) as client:
            assert (await client.get("/v1/models", headers={"Host": "evil.example"})).status_code == 403
            assert (await client.get("/v1/models", headers={"Host": "chat.example"})).status_code == 200
            assert (await client.get("/v1/models")).status_code == 200  # Host: 127.0.0.1:<port>


async def test_the_request_log_believes_only_an_allowed_proxy(caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    forwarded = {"X-Forwarded-For": "198.51.100.23"}
    with trio.fail_after(30):
        async with proxied() as client:  # default --forwarded-allow-ips: 127.0.0.1, ::1
            assert (await client.get("/v1/models", headers=forwarded)).status_code == 200
        async with proxied(forwarded_allow_ips=("192.0.2.1",)) as client:  # the forwarder is not it
            assert (await client.get("/v1/models", headers=forwarded)).status_code == 200
    assert logged_clients(caplog) == ["198.51.100.23", "127.0.0.1"]
