"""Mistral: `[TOOL_CALLS]` then `[{"name", "arguments"}, …]` or `name[ARGS]{json}`; no end marker."""

from __future__ import annotations

import json
import re

from api.pipeline.events import ToolCall
from api.pipeline.tools.calls import call_from_json_object
from api.pipeline.tools.tagged import TaggedCallRouter

TOOL_CALLS_MARKER = "[TOOL_CALLS]"
_ARGS_HEADER = re.compile(r"\s*([\w\-.]+)\s*\[ARGS\]\s*")


def parse_mistral_body(body: str) -> list[ToolCall]:
    # Newer Mistral templates repeat the marker before each call.
    calls: list[ToolCall] = []
    for chunk in body.split(TOOL_CALLS_MARKER):
        if chunk.strip():
            calls.extend(_parse_chunk(chunk.strip()))
    if not calls:
        raise ValueError("no tool call after [TOOL_CALLS]")
    return calls


def _parse_chunk(chunk: str) -> list[ToolCall]:
    if chunk.startswith("["):
        payload = json.loads(chunk)
        if not isinstance(payload, list):
            raise ValueError("not a list of calls")
        return [call_from_json_object(item) for item in payload]
    decoder = json.JSONDecoder()
    calls = []
    position = 0
    while position < len(chunk):
        header = _ARGS_HEADER.match(chunk, position)
        if header is None:
            raise ValueError(f"expected name[ARGS] at {chunk[position:]!r}")
        arguments, position = decoder.raw_decode(chunk, header.end())
        if not isinstance(arguments, dict):
            raise ValueError("tool call arguments are not an object")
        calls.append(ToolCall.create(header.group(1), arguments))
        while position < len(chunk) and chunk[position].isspace():
            position += 1
    return calls


def mistral_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALLS_MARKER, None, parse_mistral_body)
