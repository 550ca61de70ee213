"""Mistral: `[TOOL_CALLS]` then `[{"name", "arguments"}, …]` or `name[ARGS]{json}`; no end marker.
Newer templates repeat the marker before each call (the router starts a new parser there)."""

from __future__ import annotations

import re

from api.pipeline.tools.json_calls import JsonCallParser
from api.pipeline.tools.json_scan import JsonScanner, MarkupError
from api.pipeline.tools.tagged import TaggedCallRouter

TOOL_CALLS_MARKER = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
_NAME_CHAR = re.compile(r"[\w\-.]")


class MistralCallParser(JsonCallParser):
    """The JSON forms, and `name[ARGS]{…}` calls back to back, whose header goes out at the `{`."""

    def __init__(self) -> None:
        super().__init__(lists=True)
        self._tag = 0  # how much of [ARGS] has been read

    def _end(self, *, closed: bool) -> None:
        if self._state.startswith("named_"):
            raise MarkupError("the call breaks off")
        super()._end(closed=closed)

    def _between_other(self, text: str, i: int) -> int:
        if not _NAME_CHAR.match(text[i]):
            return super()._between_other(text, i)
        self._name, self._tag, self._state = "", 0, "named_name"
        return i

    def _on_named_name(self, text: str, i: int) -> int:
        c = text[i]
        if _NAME_CHAR.match(c):
            self._name = (self._name or "") + c
            return i + 1
        self._state = "named_tag"
        return i

    def _on_named_tag(self, text: str, i: int) -> int:
        c = text[i]
        if self._tag == 0 and c.isspace():
            return i + 1
        if c != ARGS_TAG[self._tag]:
            raise MarkupError(f"expected {ARGS_TAG} after the call's name")
        self._tag += 1
        if self._tag == len(ARGS_TAG):
            self._state = "named_gap"
        return i + 1

    def _on_named_gap(self, text: str, i: int) -> int:
        c = text[i]
        if c.isspace():
            return i + 1
        if c != "{":
            raise MarkupError("a call's arguments must be one object")
        self._start(self._name or "")
        self._scanner, self._state = JsonScanner(), "named_arguments"
        return i

    def _on_named_arguments(self, text: str, i: int) -> int:
        end = self._scanner.feed(text, i)
        self._args(text[i:] if end < 0 else text[i:end])
        if end < 0:
            return len(text)
        self._close()
        self._state = "between"
        return end


def mistral_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALLS_MARKER, None, MistralCallParser)
