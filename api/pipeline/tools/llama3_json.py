"""Llama 3.x JSON tool calls: the whole reply is `{"name", "parameters"}` (or a list of them),
optionally after `<|python_tag|>`."""

from __future__ import annotations

from api.pipeline.tools.base import RoutedItem
from api.pipeline.tools.json_calls import JsonCallParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonRouter:
    """There is no marker, so the first visible character decides: `{`, `[` or the python tag
    means a call, whose header and arguments then stream as they are parsed; anything else is
    prose and streams live. A reply that looked like a call but fails before a call header went
    out is released as content (and the rest streams as prose); once one went out, text that
    does not parse after it is dropped."""

    def __init__(self) -> None:
        self._mode = "undecided"  # "undecided" | "prose" | "call"
        self._buffer = ""  # the reply so far while undecided, or while no call of it went out
        self._parser = JsonCallParser(lists=True)

    def feed(self, text: str) -> list[RoutedItem]:
        if self._mode == "prose":
            return [text] if text else []
        if self._mode == "call":
            return self._to_parser(text, raw=text)
        self._buffer += text
        start = self._buffer.lstrip()
        self._mode = _classify(start)
        if self._mode == "prose":
            buffer, self._buffer = self._buffer, ""
            return [buffer]
        if self._mode == "call":
            raw, self._buffer = self._buffer, ""
            return self._to_parser(start.removeprefix(PYTHON_TAG), raw=raw)
        return []

    def finish(self) -> list[RoutedItem]:
        items: list[RoutedItem] = []
        if self._mode == "call":
            items += self._parser.end(closed=False)
            if not self._parser.committed:
                items.append(self._buffer)
        elif self._mode == "undecided":
            items.append(self._buffer)
        self._buffer = ""
        return [item for item in items if item != ""]

    def _to_parser(self, body: str, *, raw: str) -> list[RoutedItem]:
        """Feed `body` (the reply's text, less what precedes the first call); `raw` is the text
        as it came, kept for a verbatim release until a call went out."""
        if not self._parser.committed:
            self._buffer += raw
        items: list[RoutedItem] = list(self._parser.feed(body))
        if self._parser.failed and not self._parser.committed:
            buffer, self._buffer, self._mode = self._buffer, "", "prose"
            return [buffer]
        if self._parser.committed:
            self._buffer = ""
        return items


def _classify(start: str) -> str:
    if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
        return "undecided"
    if start[0] in "{[" or start.startswith(PYTHON_TAG):
        return "call"
    return "prose"
