"""Router for formats whose calls sit between a start marker and an end marker (or the end)."""

from __future__ import annotations

from collections.abc import Callable

from api.pipeline.events import ToolCall
from api.pipeline.markers import partial_marker_length
from api.pipeline.tools.base import RoutedItem

BodyParser = Callable[[str], list[ToolCall]]


class TaggedCallRouter:
    """Prose streams live; markup from the start marker on is withheld until it is parsed.

    `end=None` means the call runs to the end of generation (Mistral's `[TOOL_CALLS]`).
    A block that fails to parse is released verbatim as prose (fail soft). Whitespace between
    and after calls is dropped so a pure tool-call turn ends up with empty content.
    """

    def __init__(self, start: str, end: str | None, parse_body: BodyParser) -> None:
        self._start = start
        self._end = end
        self._parse_body = parse_body
        self._state = "prose"  # "prose" | "call" | "after_call"
        self._buffer = ""

    def feed(self, text: str) -> list[RoutedItem]:
        self._buffer += text
        items: list[RoutedItem] = []
        while self._step(items):
            pass
        return items

    def finish(self) -> list[RoutedItem]:
        buffer, self._buffer = self._buffer, ""
        if self._state == "call":
            return self._parsed_or_verbatim(buffer, closed=False)
        if self._state == "after_call" and not buffer.strip():
            return []
        return [buffer] if buffer else []

    def _step(self, items: list[RoutedItem]) -> bool:
        """Advance one state transition; False once the buffer needs more text."""
        buffer = self._buffer
        if self._state == "prose":
            at = buffer.find(self._start)
            if at < 0:
                keep = partial_marker_length(buffer, (self._start,))
                _add_prose(items, buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            _add_prose(items, buffer[:at])
            self._buffer = buffer[at + len(self._start) :]
            self._state = "call"
            return True
        if self._state == "call":
            end = self._end
            at = buffer.find(end) if end else -1
            if end is None or at < 0:
                return False
            self._buffer = buffer[at + len(end) :]
            items.extend(self._parsed_or_verbatim(buffer[:at], closed=True))
            return True
        # after_call: whitespace is held until we know whether another call follows.
        rest = buffer.lstrip()
        if not rest or (self._start.startswith(rest) and rest != self._start):
            return False
        if rest.startswith(self._start):
            self._buffer = rest
        self._state = "prose"
        return True

    def _parsed_or_verbatim(self, body: str, *, closed: bool) -> list[RoutedItem]:
        try:
            calls = self._parse_body(body)
        except ValueError:
            calls = []
        if not calls:
            self._state = "prose"
            return [self._start + body + (self._end if closed and self._end else "")]
        self._state = "after_call"
        return list(calls)


def _add_prose(items: list[RoutedItem], text: str) -> None:
    if text:
        items.append(text)
