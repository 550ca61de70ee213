"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`."""

from __future__ import annotations

from api.pipeline.tools.json_calls import JsonCallParser
from api.pipeline.tools.tagged import TaggedCallRouter

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def hermes_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALL_START, TOOL_CALL_END, lambda: JsonCallParser(lists=False))
