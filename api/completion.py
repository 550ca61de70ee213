"""Reading an admitted generation's text events, whatever protocol encodes them.

A whole-completion collector (for JSON answers), the accumulator the Anthropic and Responses
streams keep alongside their events, a keepalive-aware wait for the next events, and the log
line for a stream that fails after its headers went out.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any, Literal

import attrs
import trio

from actors.request import GenerationFailed, RequestActor
from api.errors import ApiError
from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallsEvent

log = logging.getLogger(__name__)


class _Wait(enum.Enum):
    TIMED_OUT = "timed out"


TIMED_OUT = _Wait.TIMED_OUT
"""`next_events_or_timeout`'s answer when no event arrived in time."""


@attrs.define
class Completion:
    """One finished completion, accumulated from the actor's text events."""

    # The text as pieces (`+=` on an attribute copies the whole string every event).
    content_parts: list[str] = attrs.Factory(list)
    reasoning_parts: list[str] = attrs.Factory(list)
    calls: list[ToolCall] = attrs.Factory(list)
    finish_reason: str | None = None
    usage: dict[str, Any] = attrs.Factory(dict)
    matched_stop: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


def add_events(completion: Completion, events: list[Event]) -> None:
    for event in events:  # a call's streamed pieces are skipped: ToolCallsEvent has it whole
        if isinstance(event, ToolCallsEvent):
            completion.calls.extend(event.calls)
        elif isinstance(event, TextDelta) and event.kind == "reasoning":
            completion.reasoning_parts.append(event.text)
        elif isinstance(event, TextDelta):
            completion.content_parts.append(event.text)


def finish(completion: Completion, actor: RequestActor[Event]) -> Completion:
    """Record how the completion ended (the actor's finish reason, usage and stop string)."""
    completion.finish_reason = actor.finish_reason
    completion.usage = actor.usage()
    completion.matched_stop = actor.matched_stop if actor.finish_reason == "stop" else None
    return completion


async def collect(actor: RequestActor[Event], on_events: Callable[[list[Event]], object] | None = None) -> Completion:
    """Run an admitted generation to its end; closes the actor. A failure → ApiError with its
    status (500 from the engine, 400 for an output constraint that failed). `on_events` sees
    every batch of events too (an encoder building the answer in generation order)."""
    completion = Completion()
    try:
        while (events := await actor.next_events()) is not None:
            add_events(completion, events)
            if on_events is not None:
                on_events(events)
    except GenerationFailed as exc:
        raise ApiError(exc.status, str(exc)) from exc
    finally:
        actor.close()
    return finish(completion, actor)


async def next_events_or_timeout(
    actor: RequestActor[Event], timeout: float
) -> list[Event] | None | Literal[_Wait.TIMED_OUT]:
    """`actor.next_events()`, or `TIMED_OUT` after `timeout` seconds without an event.

    Cancelling the wait loses nothing: the actor only ever blocks in a memory-channel receive,
    which either delivers an item or raises, and processes what it received synchronously.
    """
    result: list[Event] | None | Literal[_Wait.TIMED_OUT] = TIMED_OUT
    with trio.move_on_after(timeout):
        result = await actor.next_events()
    return result


def log_stream_failure(exc: BaseException, surface: str) -> None:
    if not isinstance(exc, GenerationFailed):  # the scheduler already logged a worker failure
        log.exception("%s stream failed", surface, exc_info=exc)
