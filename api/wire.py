"""Reading JSON request bodies and writing JSON / SSE responses, for every protocol.

The OpenAI routes write ASCII-escaped JSON (`json.dumps` defaults, as mlx_lm.server does) and
bare `data:` frames; the Anthropic and Responses routes write UTF-8 JSON and named SSE events,
and ask proxies not to buffer their streams.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, request

from api.errors import bad_request

DONE_FRAME = b"data: [DONE]\n\n"


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


def sse_response(body: AsyncIterator[bytes], *, unbuffered: bool = True) -> Response:
    """An event stream; `unbuffered` adds `X-Accel-Buffering: no` for nginx-style proxies."""
    headers = {"Cache-Control": "no-cache"}
    if unbuffered:
        headers["X-Accel-Buffering"] = "no"
    response = Response(body, content_type="text/event-stream", headers=headers)
    response.timeout = None  # a long generation is not a stuck response
    return response


def sse_event(event_type: str, payload: dict[str, Any]) -> bytes:
    """A named SSE event (Anthropic, Responses)."""
    return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def data_frame(payload: Any) -> bytes:
    """An unnamed `data:` frame with ASCII-escaped JSON (OpenAI chat and completions)."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
