"""Events produced by the per-token text pipeline of one completion."""

from __future__ import annotations

import secrets
from typing import Literal

import attrs

TextKind = Literal["content", "reasoning"]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(4)}"


@attrs.frozen
class ToolCall:
    """One parsed call in the OpenAI shape; `arguments` is a JSON string, not a dict (the text
    its ToolCallDelta events carried, concatenated: see api/pipeline/tools/json_calls.py)."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class TextDelta:
    kind: TextKind
    text: str


@attrs.frozen
class ToolCallStart:
    """A call's header, as soon as its name is known; its arguments follow as ToolCallDelta.
    `index`: its place among the completion's calls."""

    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallDelta:
    """More of call `index`'s arguments string."""

    index: int
    arguments: str


@attrs.frozen
class ToolCallsEvent:
    """Every call of the completion, emitted once at the end (after their streamed events): what
    a whole (non-streamed) answer reports. Streams skip the calls they already sent."""

    calls: tuple[ToolCall, ...]


Event = TextDelta | ToolCallStart | ToolCallDelta | ToolCallsEvent
