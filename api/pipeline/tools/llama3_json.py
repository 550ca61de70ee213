"""Llama 3.x JSON tool calls: the whole reply is `{"name", "parameters"}` (or a list of them),
optionally after `<|python_tag|>`."""

from __future__ import annotations

from api.pipeline.events import ToolCall
from api.pipeline.tools.base import RoutedItem
from api.pipeline.tools.calls import call_from_json_object, json_values

PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    calls: list[ToolCall] = []
    for value in json_values(body):
        items = value if isinstance(value, list) else [value]
        calls.extend(call_from_json_object(item) for item in items)
    if not calls:
        raise ValueError("no tool call")
    return calls


class Llama3JsonRouter:
    """There is no marker, so the first visible character decides: `{`, `[` or the python tag
    means a call and the reply is withheld to the end; anything else is prose and streams live.
    A reply that looked like a call but does not parse is released as content."""

    def __init__(self) -> None:
        self._mode = "undecided"  # "undecided" | "prose" | "call"
        self._buffer = ""

    def feed(self, text: str) -> list[RoutedItem]:
        if self._mode == "prose":
            return [text] if text else []
        self._buffer += text
        if self._mode == "undecided":
            self._mode = _classify(self._buffer.lstrip())
            if self._mode == "prose":
                buffer, self._buffer = self._buffer, ""
                return [buffer]
        return []

    def finish(self) -> list[RoutedItem]:
        buffer, self._buffer = self._buffer, ""
        if self._mode == "call":
            try:
                return list(parse_llama3_json(buffer))
            except ValueError:
                pass
        return [buffer] if buffer else []


def _classify(start: str) -> str:
    if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
        return "undecided"
    if start[0] in "{[" or start.startswith(PYTHON_TAG):
        return "call"
    return "prose"
