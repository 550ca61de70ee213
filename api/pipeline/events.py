"""Events produced by the per-token text pipeline of one completion."""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

import attrs

TextKind = Literal["content", "reasoning"]


@attrs.frozen
class ToolCall:
    """One parsed call in the OpenAI shape; `arguments` is a JSON string, not a dict."""

    id: str
    name: str
    arguments: str

    @classmethod
    def create(cls, name: str, arguments: Any) -> ToolCall:
        # ensure_ascii=False keeps non-ASCII arguments readable, as mlx-lm's formatter does.
        return cls(
            id=f"call_{secrets.token_hex(4)}",
            name=name,
            arguments=json.dumps(arguments, ensure_ascii=False),
        )


@attrs.frozen
class TextDelta:
    kind: TextKind
    text: str


@attrs.frozen
class ToolCallsEvent:
    """Every call of the completion, emitted once at the end."""

    calls: tuple[ToolCall, ...]


Event = TextDelta | ToolCallsEvent
