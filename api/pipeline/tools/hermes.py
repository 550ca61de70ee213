"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`."""

from __future__ import annotations

from api.pipeline.events import ToolCall
from api.pipeline.tools.calls import call_from_json_object, json_values
from api.pipeline.tools.tagged import TaggedCallRouter

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def parse_hermes_body(body: str) -> list[ToolCall]:
    values = json_values(body)
    if not values:
        raise ValueError("empty tool call")
    return [call_from_json_object(value) for value in values]


def hermes_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALL_START, TOOL_CALL_END, parse_hermes_body)
