"""What the Anthropic and Responses surfaces share: reading an admitted chat's events.

Both surfaces translate their request into an OpenAI-chat body, call `start_chat` (the one
generation path) and then only encode. This module holds the encoding-independent parts: a
whole-completion collector, a keepalive-aware wait for the next events, the stop-string accessor
and SSE framing.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

import attrs
import trio
from quart import Response, request

from actors.request import GenerationFailed
from api.errors import ApiError, bad_request

log = logging.getLogger(__name__)

TIMED_OUT: Any = object()
"""`next_events_or_timeout`'s answer when no event arrived in time."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"  # 24 hex digits, as spec §1.4 / §1.5


@attrs.define
class Completion:
    """One finished completion, accumulated from the actor's text events."""

    content: str = ""
    reasoning: str = ""
    calls: list[Any] = attrs.Factory(list)
    finish_reason: str | None = None
    usage: dict[str, Any] = attrs.Factory(dict)
    matched_stop: str | None = None


async def json_body() -> dict[str, Any]:
    # force=True: a missing or wrong Content-Type must not turn a valid body into None.
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise bad_request("invalid JSON body")
    return body


def matched_stop(actor: Any) -> str | None:
    """The stop string that ended the completion, if one did (`RequestActor.matched_stop`)."""
    value = getattr(actor, "matched_stop", None)
    return value if isinstance(value, str) else None


def add_events(completion: Completion, events: list[Any]) -> None:
    for event in events:
        if hasattr(event, "calls"):
            completion.calls.extend(event.calls)
        elif event.kind == "reasoning":
            completion.reasoning += event.text
        else:
            completion.content += event.text


def finish(completion: Completion, actor: Any) -> Completion:
    completion.finish_reason = actor.finish_reason
    completion.usage = actor.usage()
    completion.matched_stop = matched_stop(actor) if actor.finish_reason == "stop" else None
    return completion


async def collect(actor: Any) -> Completion:
    """Run an admitted chat to its end; closes the actor. Engine failure → ApiError(500)."""
    completion = Completion()
    try:
        while (events := await actor.next_events()) is not None:
            add_events(completion, events)
    except GenerationFailed as exc:
        raise ApiError(500, str(exc)) from exc
    finally:
        actor.close()
    return finish(completion, actor)


async def next_events_or_timeout(actor: Any, timeout: float | None) -> Any:
    """`actor.next_events()`, or `TIMED_OUT` after `timeout` seconds without an event.

    Cancelling the wait loses nothing: the actor only ever blocks in a memory-channel receive,
    which either delivers an item or raises, and processes what it received synchronously.
    """
    if timeout is None:
        return await actor.next_events()
    result = TIMED_OUT
    with trio.move_on_after(timeout):
        result = await actor.next_events()
    return result


def sse_event(event_type: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def sse_response(body: Any) -> Response:
    response = Response(
        body,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None  # a long generation is not a stuck response
    return response


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    response = Response(json.dumps(payload, ensure_ascii=False), status=status, content_type="application/json")
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def log_stream_failure(exc: BaseException, surface: str) -> None:
    if not isinstance(exc, GenerationFailed):  # the scheduler already logged a worker failure
        log.exception("%s stream failed", surface, exc_info=exc)
