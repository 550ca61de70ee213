"""Keep-alive connections that no request can jam: the app's side of hypercorn's HTTP/1.1 cycle.

hypercorn (protocol/h11.py) finishes a request's cycle inside the app's last `send`: that call
writes the response's end, then `_maybe_recycle` tells the app's receive channel
`http.disconnect` and either starts the connection's next cycle and re-arms its idle timer
(`keep_alive_timeout`), or closes the socket when the response was `Connection: close` or the
request body was not fully received. quart-trio's connection cancels its own nursery the moment
its message task sees that `http.disconnect`, and the handler task that is still inside the
last `send` is in that nursery: the rest of the bookkeeping dies at its next checkpoint. So

* the idle timer is never re-armed: idle keep-alive connections stay open forever;
* the close after `Connection: close` (the client's, or ours) never happens;
* after an early answer (401, 404, 405, 413, /admin/cache/flush: any route that answers before
  the body has arrived), the socket stays open, hypercorn's reader discards the rest of the
  body and parks the next request as h11 PAUSED, waiting for a cycle change that never comes:
  the next request on that connection is never answered.

`ApiHTTPConnection` (the app's `asgi_http_class`) fixes both halves:

* the last `send` of a response runs shielded, so hypercorn's recycle-or-close always completes
  (hypercorn already shields its socket writes, so the shield adds no new way to block);
* a response that starts before the request body was fully received first drains it, bounded by
  `DRAIN_SECONDS` and the body cap (quart keeps at most `--max-body-mb` of it and drops the
  rest), so the connection can be reused; when the body does not end within those bounds, the
  response carries `Connection: close` and hypercorn closes the connection after it.
"""

from __future__ import annotations

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    HTTPResponseStartEvent,
    HTTPScope,
)
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

DRAIN_SECONDS = 2.0  # how long an early answer waits for the rest of the request body
DRAIN_CAP_FACTOR = 2  # drain up to this many body caps (an over-cap body is dropped as it comes)
UNCAPPED_DRAIN_BYTES = 64 << 20  # the drain bound when --max-body-mb is 0 (no cap)
CLOSE_AT_ONCE = frozenset({408})  # a body that timed out is not waited for again


def drain_limit(max_body_bytes: int | None) -> int:
    """Bytes of request body an early answer may wait for before it closes the connection."""
    return UNCAPPED_DRAIN_BYTES if max_body_bytes is None else DRAIN_CAP_FACTOR * max_body_bytes


class RequestBody:
    """What hypercorn has delivered of one request's body, seen through the app's `receive`."""

    def __init__(self, scope: HTTPScope, limit: int) -> None:
        self.limit = limit
        self.declared = declared_length(scope)
        self.received = 0
        self.ended = trio.Event()  # the last body message, or the client went away
        self.too_big = trio.Event()  # more than `limit` arrived: not worth waiting for
        if not has_body(scope):
            self.ended.set()
        elif self.declared is not None and self.declared > limit:
            self.too_big.set()

    def wrap_receive(self, receive: ASGIReceiveCallable) -> ASGIReceiveCallable:
        async def tracked() -> ASGIReceiveEvent:
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.limit:
                    self.too_big.set()
                if not message.get("more_body", False):
                    self.ended.set()
            elif message["type"] == "http.disconnect":
                self.ended.set()
            return message

        return tracked

    async def drained(self, status: int) -> bool:
        """Wait (bounded) for the rest of the body; True when the connection stays reusable."""
        if self.ended.is_set():
            return True
        if self.too_big.is_set() or status in CLOSE_AT_ONCE:
            return False
        with trio.move_on_after(DRAIN_SECONDS):
            async with trio.open_nursery() as nursery:

                async def first(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(first, self.ended)
                nursery.start_soon(first, self.too_big)
        return self.ended.is_set()


def has_body(scope: HTTPScope) -> bool:
    headers = {name.lower(): value.strip() for name, value in scope["headers"]}
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") not in (b"", b"0")


def declared_length(scope: HTTPScope) -> int | None:
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def with_connection_close(message: HTTPResponseStartEvent) -> HTTPResponseStartEvent:
    """The response start with `Connection: close`: hypercorn closes the connection after it."""
    headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class ApiHTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection with a drained-or-closed request body and a shielded end."""

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        body = RequestBody(self.scope, drain_limit(self.app.config.get("MAX_CONTENT_LENGTH")))

        async def guarded_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start":
                if not await body.drained(int(message["status"])):
                    message = with_connection_close(message)
                await send(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # hypercorn recycles or closes the connection inside this call (see above).
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(body.wrap_receive(receive), guarded_send)


def install_connection_guard(app: QuartTrio) -> None:
    """Make `app` answer HTTP through `ApiHTTPConnection`."""
    app.asgi_http_class = ApiHTTPConnection
