"""Turns a decoded JSON call object into a ToolCall, shared by the JSON-bodied formats."""

from __future__ import annotations

import json
from typing import Any

from api.pipeline.events import ToolCall


def call_from_json_object(obj: Any) -> ToolCall:
    """`{"name": str, "arguments"|"parameters": object}`; raises ValueError for anything else.

    Arguments given as a JSON string are decoded first: some templates render them that way,
    and re-encoding a string would hand the client a doubly quoted value.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {obj!r}")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments are not an object: {arguments!r}")
    return ToolCall.create(obj["name"], arguments)


def json_values(text: str) -> list[Any]:
    """Every JSON value in `text`, back to back, separated by whitespace or ';'."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)
