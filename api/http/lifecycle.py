"""The server's lifecycle as clients and load balancers see it: loading, serving, draining.

The root binds the port before the model loads (actors/root.py), so hypercorn serves a
`LifecycleApp` from its first moment:

* loading — every request is answered 503 + Retry-After without reading its body: /health with
  `{"status": "loading"}`, each API in its own error envelope (code `model_loading`);
* serving — `serve(app)` hands every later request to the app built from the loaded server;
* draining — the first SIGINT/SIGTERM closes admission: /health answers 503 "shutting down"
  (api/observability/health.py), every new or still queued generation request 503 + Retry-After in its API's
  envelope (actors/admission.py), while requests already generating finish.

hypercorn's ASGI lifespan events are answered here: the app owns nothing that needs them.
"""

from __future__ import annotations

import json

import trio
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope
from quart.wrappers.response import DataBody

from api.errors import ApiError, error_response_for

RETRY_AFTER_LOADING_S = 5  # a model load takes seconds to minutes: poll gently
LOADING_BODY = {"status": "loading"}


class LifecycleApp:
    """The ASGI app hypercorn serves: answers 503 until `serve(app)`, then delegates to it."""

    def __init__(self) -> None:
        self._app: ASGIFramework | None = None
        self.served = trio.Event()  # set once the loaded server's app answers

    @property
    def app(self) -> ASGIFramework | None:
        """The loaded server's app; None while loading."""
        return self._app

    def serve(self, app: ASGIFramework) -> None:
        self._app = app
        self.served.set()

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif self._app is not None:
            await self._app(scope, receive, send)
        elif scope["type"] == "http":
            await _answer_loading(scope["path"], send)
        else:  # a websocket: refused before it is accepted
            await send({"type": "websocket.close", "code": 1013, "reason": "model is loading"})


async def _lifespan(receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def loading_response(path: str) -> bytes:
    """The JSON body of the 503 a request to `path` gets while the model loads."""
    if path == "/health":
        return json.dumps(LOADING_BODY).encode()
    response = error_response_for(
        path, ApiError(503, "the model is still loading; retry shortly", code="model_loading")
    )
    body = response.response
    assert isinstance(body, DataBody)  # error_response_for builds its body from bytes
    return body.data


async def _answer_loading(path: str, send: ASGISendCallable) -> None:
    body = loading_response(path)
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_LOADING_S).encode()),
                (b"cache-control", b"no-store"),
                # The body was not read: a reused connection would start mid-body.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
