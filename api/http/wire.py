"""Reading JSON request bodies and writing JSON / SSE responses, for every protocol.

The OpenAI routes write ASCII-escaped JSON (`json.dumps` defaults, as mlx_lm.server does) and
bare `data:` frames; the Anthropic and Responses routes write UTF-8 JSON and named SSE events.
Every stream asks proxies not to buffer it (`X-Accel-Buffering: no`, `Cache-Control: no-cache`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, request

from api.errors import bad_request

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"  # an SSE comment: every client's parser skips it
KEEPALIVE_INTERVAL_S = 10.0
"""An OpenAI or Responses stream with no frame for this long (a long prefill before the first
token) sends `KEEPALIVE_FRAME`, well inside the usual proxy idle timeouts (nginx's
proxy_read_timeout and most load balancers': 60 s). Anthropic streams send their protocol's
`ping` event instead (api/anthropic/routes.py)."""


def new_id(prefix: str, *, separator: str = "_") -> str:
    """`prefix` + separator + 24 random hex digits."""
    return f"{prefix}{separator}{secrets.token_hex(12)}"


async def json_body() -> dict[str, Any]:
    """The request's JSON object; anything else is a 400 "invalid JSON body"."""
    # force=True: a missing or wrong Content-Type must not turn a valid body into None.
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise bad_request("invalid JSON body")
    return body


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None, *, ensure_ascii: bool = False
) -> Response:
    response = Response(json.dumps(payload, ensure_ascii=ensure_ascii), status=status, content_type="application/json")
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def sse_response(body: AsyncIterator[bytes]) -> Response:
    """An event stream. `X-Accel-Buffering: no` keeps nginx from holding the frames back (by
    default it buffers a response and sends it on in bursts); `Cache-Control: no-cache` keeps any
    cache from storing it."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    response = Response(body, content_type="text/event-stream", headers=headers)
    response.timeout = None  # a long generation is not a stuck response
    return response


def sse_event(event_type: str, payload: dict[str, Any]) -> bytes:
    """A named SSE event (Anthropic, Responses)."""
    return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def data_frame(payload: Any) -> bytes:
    """An unnamed `data:` frame with ASCII-escaped JSON (OpenAI chat and completions)."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
