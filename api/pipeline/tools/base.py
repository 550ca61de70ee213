"""What every tool router hands the rest of the pipeline, and the parser of one call block."""

from __future__ import annotations

from typing import Protocol

import attrs

from api.pipeline.tools.json_scan import MarkupError


@attrs.frozen
class CallStart:
    """A call begins: its name is known (the header can go out) and its arguments follow."""

    name: str


@attrs.frozen
class CallArgs:
    """More of the open call's arguments text; the pieces concatenate to the whole string."""

    text: str


@attrs.frozen
class CallEnd:
    """The open call is over. `cut`: its arguments stopped unfinished (generation ended inside
    them, or the markup broke off after the header went out): they are what was streamed."""

    cut: bool = False


CallItem = CallStart | CallArgs | CallEnd

# Prose and call pieces in stream order, so the sink can drop what comes after a stop match.
RoutedItem = str | CallItem


class ToolRouter(Protocol):
    def feed(self, text: str) -> list[RoutedItem]:
        """Consume decoded text; return prose that is safe to pass on and call pieces."""
        ...

    def finish(self) -> list[RoutedItem]:
        """End of generation: close an open call, or release withheld markup as prose."""
        ...


class PlainRouter:
    """No tools in the request: every character is prose."""

    def feed(self, text: str) -> list[RoutedItem]:
        return [text] if text else []

    def finish(self) -> list[RoutedItem]:
        return []


class CallParser:
    """Parses one block of call markup as it arrives, emitting each call's header once its name
    and the start of its arguments are known, then the arguments as they come.

    The first header is the point of no return: until then a failure (`failed`) leaves the block
    to its router, which releases it verbatim as prose; after it, the header and arguments are
    already with the client, so a failure ends the open call where it broke (`CallEnd(cut=True)`)
    and the rest of the block is ignored. Subclasses implement `_consume` and `_end`, raising
    MarkupError.
    """

    def __init__(self) -> None:
        self.committed = False  # a header went out
        self.failed = False
        self.in_call = False
        self._items: list[CallItem] = []

    def feed(self, text: str) -> list[CallItem]:
        if text and not self.failed:
            try:
                self._consume(text)
            except MarkupError:
                self._fail()
        return self._take()

    def end(self, *, closed: bool) -> list[CallItem]:
        """The block is over: `closed` by its end marker, or by the end of generation."""
        if not self.failed:
            try:
                self._end(closed=closed)
            except MarkupError:
                self._fail()
        return self._take()

    def _consume(self, text: str) -> None:
        raise NotImplementedError

    def _end(self, *, closed: bool) -> None:
        raise NotImplementedError

    def _start(self, name: str, arguments: str = "") -> None:
        self._items.append(CallStart(name))
        self.committed = self.in_call = True
        self._args(arguments)

    def _args(self, text: str) -> None:
        if text:
            self._items.append(CallArgs(text))

    def _close(self, *, cut: bool = False) -> None:
        self._items.append(CallEnd(cut=cut))
        self.in_call = False

    def _fail(self) -> None:
        self.failed = True
        if self.in_call:
            self._close(cut=True)

    def _take(self) -> list[CallItem]:
        items, self._items = self._items, []
        return items
