"""Router for formats whose calls sit between a start marker and an end marker (or the end)."""

from __future__ import annotations

from collections.abc import Callable

from api.pipeline.markers import partial_marker_length
from api.pipeline.tools.base import CallParser, RoutedItem


class TaggedCallRouter:
    """Prose streams live; markup from the start marker on goes to a parser, which streams calls.

    `end=None` means the markup runs to the end of generation (Mistral's `[TOOL_CALLS]`); there a
    repeated start marker begins a new parser. A block that fails before its first call header
    went out is released verbatim as prose (fail soft), right away, and it runs on as prose to
    its end marker. Once a header went out it cannot be taken back: a failure ends that call where
    it broke (the parser closes it) and the rest of the block is dropped. Whitespace between and
    after calls is dropped so a pure tool-call turn ends up with empty content.
    """

    def __init__(self, start: str, end: str | None, new_parser: Callable[[], CallParser]) -> None:
        self._start = start
        self._end = end
        self._new_parser = new_parser
        self._state = "prose"  # "prose" | "call" | "failed" | "dropping" | "after_call"
        self._buffer = ""  # text not routed yet: what may start a marker
        self._parser = new_parser()
        self._raw = ""  # the block's text while none of it went out as a call
        self._committed = False  # a call header of this block went out

    def feed(self, text: str) -> list[RoutedItem]:
        self._buffer += text
        items: list[RoutedItem] = []
        while self._step(items):
            pass
        return items

    def finish(self) -> list[RoutedItem]:
        buffer, self._buffer = self._buffer, ""
        items: list[RoutedItem] = []
        if self._state == "call":
            self._to_parser(items, buffer)
            if self._state == "call":
                self._end_block(items, closed=False)
        elif self._state in ("prose", "failed") or (self._state == "after_call" and buffer.strip()):
            items.append(buffer)
        return [item for item in items if item != ""]

    def _step(self, items: list[RoutedItem]) -> bool:
        """Advance one state transition; False once the buffer needs more text."""
        buffer = self._buffer
        if self._state == "prose":
            at = buffer.find(self._start)
            if at < 0:
                self._buffer = self._release(items, buffer, (self._start,), prose=True)
                return False
            _add_prose(items, buffer[:at])
            self._buffer = buffer[at + len(self._start) :]
            self._state, self._parser, self._raw, self._committed = "call", self._new_parser(), "", False
            return True
        if self._state in ("call", "failed", "dropping"):
            return self._in_block(items)
        # after_call: whitespace is held until we know whether another call follows.
        rest = buffer.lstrip()
        if not rest or (self._start.startswith(rest) and rest != self._start):
            return False
        if rest.startswith(self._start):
            self._buffer = rest
        self._state = "prose"
        return True

    def _in_block(self, items: list[RoutedItem]) -> bool:
        marker = self._end or self._start  # without an end marker, the start marker cuts chunks
        at = self._buffer.find(marker)
        if at < 0:
            self._buffer = self._release(items, self._buffer, (marker,), prose=self._state == "failed")
            return False
        body, self._buffer = self._buffer[:at], self._buffer[at + len(marker) :]
        if self._state == "call":
            self._to_parser(items, body)
        elif self._state == "failed":
            _add_prose(items, body)
        if self._end is None:  # a new chunk of the same block: a fresh parser
            if self._state == "call":
                items.extend(self._parser.end(closed=True))
                self._committed |= self._parser.committed
                if self._parser.failed:
                    self._fail(items)
                elif not self._committed:
                    self._raw += marker
                self._parser = self._new_parser()
            if self._state == "failed":
                _add_prose(items, marker)
            return True
        if self._state == "call":
            self._end_block(items, closed=True)
        elif self._state == "failed":
            _add_prose(items, marker)
            self._state = "prose"
        else:
            self._state = "after_call"
        return True

    def _release(self, items: list[RoutedItem], buffer: str, markers: tuple[str, ...], *, prose: bool) -> str:
        """Pass on all of `buffer` but what may start one of `markers`; return that tail."""
        keep = partial_marker_length(buffer, markers)
        text = buffer[: len(buffer) - keep]
        if prose:
            _add_prose(items, text)
        elif self._state == "call":
            self._to_parser(items, text)
        return buffer[len(buffer) - keep :]

    def _to_parser(self, items: list[RoutedItem], text: str) -> None:
        if not self._committed:
            self._raw += text
        items.extend(self._parser.feed(text))
        self._committed |= self._parser.committed
        if self._parser.failed:
            self._fail(items)

    def _end_block(self, items: list[RoutedItem], *, closed: bool) -> None:
        items.extend(self._parser.end(closed=closed))
        self._committed |= self._parser.committed
        if self._committed:
            self._state = "after_call"
            return
        # Nothing went out: the block is prose after all (an empty block too, as before).
        end = self._end if closed and self._end else ""
        _add_prose(items, self._start + self._raw + end)
        self._raw, self._state = "", "prose"

    def _fail(self, items: list[RoutedItem]) -> None:
        if self._committed:
            self._state = "dropping"
            return
        _add_prose(items, self._start + self._raw)
        self._raw, self._state = "", "failed"


def _add_prose(items: list[RoutedItem], text: str) -> None:
    if text:
        items.append(text)
