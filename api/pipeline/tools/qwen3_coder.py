"""Qwen3-Coder: `<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>`.

The arguments string is built as json.dumps would encode the `{K: V}` object (", " and ": "
separators, non-ASCII kept), one parameter after another, so it can stream: a key goes out when
its tag is read, a value that cannot be JSON (most long ones: code, prose) streams as an escaped
JSON string, and a value that still may be JSON is held until `</parameter>` decides its type.
Text between the tags is ignored, as mlx-lm's regexes ignore it.
"""

from __future__ import annotations

import json
from typing import Any

from api.pipeline.markers import partial_marker_length
from api.pipeline.tools.base import CallParser
from api.pipeline.tools.hermes import TOOL_CALL_END, TOOL_CALL_START
from api.pipeline.tools.json_scan import JSON_WHITESPACE, JsonScanner, MarkupError
from api.pipeline.tools.tagged import TaggedCallRouter

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class Qwen3CoderParser(CallParser):
    """The header goes out with the first parameter's key (or at `</function>`, with "{}")."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "between"  # between | function_name | function | parameter_name | value
        self._buffer = ""  # unread text: a name being read, or what may start a marker
        self._name = ""
        self._value = _Value()

    def _consume(self, text: str) -> None:
        self._buffer += text
        while getattr(self, f"_on_{self._state}")():
            pass

    def _end(self, *, closed: bool) -> None:
        if self._state == "function" and self.in_call and closed:
            self._args("}")  # `</function>` is missing, but the block ended
            self._close()
        elif self._state != "between":
            raise MarkupError("the call breaks off")

    def _on_between(self) -> bool:
        return self._skip_to((FUNCTION_OPEN,)) is not None and self._goto("function_name")

    def _on_function_name(self) -> bool:
        name = self._tag_name()
        if name is None:
            return False
        self._name = name
        return self._goto("function")

    def _on_function(self) -> bool:
        found = self._skip_to((PARAMETER_OPEN, FUNCTION_CLOSE))
        if found == PARAMETER_OPEN:
            return self._goto("parameter_name")
        if found == FUNCTION_CLOSE:
            if self.in_call:
                self._args("}")
            else:
                self._start(self._name, "{}")
            self._close()
            return self._goto("between")
        return False

    def _on_parameter_name(self) -> bool:
        key = self._tag_name()
        if key is None:
            return False
        if self.in_call:
            self._args(", ")
        else:
            self._start(self._name, "{")
        self._args(json.dumps(key, ensure_ascii=False) + ": ")
        self._value = _Value()
        return self._goto("value")

    def _on_value(self) -> bool:
        at = self._buffer.find(PARAMETER_CLOSE)
        if at < 0:
            keep = partial_marker_length(self._buffer, (PARAMETER_CLOSE,))
            self._args(self._value.feed(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._args(self._value.feed(self._buffer[:at]) + self._value.end())
        self._buffer = self._buffer[at + len(PARAMETER_CLOSE) :]
        return self._goto("function")

    def _skip_to(self, markers: tuple[str, ...]) -> str | None:
        """Drop the text before the first of `markers` and the marker; None (keeping only what
        may start one) when none is there yet."""
        found = [(at, marker) for marker in markers if (at := self._buffer.find(marker)) >= 0]
        if not found:
            keep = partial_marker_length(self._buffer, markers)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return None
        at, marker = min(found)
        self._buffer = self._buffer[at + len(marker) :]
        return marker

    def _tag_name(self) -> str | None:
        """The name up to `>` (consumed), or None while it is unfinished."""
        at = self._buffer.find(">")
        name = self._buffer if at < 0 else self._buffer[:at]
        if any(c.isspace() or c == "<" for c in name) or at == 0:
            raise MarkupError("bad tag name")
        if at < 0:
            return None
        self._buffer = self._buffer[at + 1 :]
        return name

    def _goto(self, state: str) -> bool:
        self._state = state
        return True


class _Value:
    """One parameter's value as it arrives: held while it may still be JSON, streamed as an escaped
    JSON string once it cannot be. The newline the template puts on each side is not part of it."""

    def __init__(self) -> None:
        self._lead = True  # the first character (maybe the template's newline) is still to come
        self._string = False
        self._held = ""  # the whole value while it may be JSON; then the unsent tail ("\n" at most)
        self._scanner = JsonScanner()

    def feed(self, text: str) -> str:
        """What of the value's encoding can go out now."""
        if self._lead and text:
            self._lead = False
            text = text.removeprefix("\n")
        out = ""
        if not self._string:
            self._held += text
            if self._may_be_json(text):
                return ""
            self._string, out, text = True, '"', ""
        pending = self._held + text
        self._held = "\n" if pending.endswith("\n") else ""  # maybe the template's closing newline
        return out + _escape(pending[: len(pending) - len(self._held)])

    def end(self) -> str:
        value = self._held.removesuffix("\n")
        return _escape(value) + '"' if self._string else json.dumps(coerce_parameter(value), ensure_ascii=False)

    def _may_be_json(self, text: str) -> bool:
        try:
            if self._scanner.done:
                return not text.strip(JSON_WHITESPACE)
            end = self._scanner.feed(text)
        except MarkupError:
            return False
        return end < 0 or not text[end:].strip(JSON_WHITESPACE)


def coerce_parameter(value: str) -> Any:
    """Values are untyped text; we take the JSON reading when there is one, else the string.

    mlx-lm coerces from the tool's JSON schema; the pipeline does not see schemas, and a JSON
    reading gets numbers, booleans, null, objects and arrays right for well-behaved models.
    """
    try:
        return json.loads(value, parse_constant=_reject_non_json_constant)
    except ValueError:
        return value


def _reject_non_json_constant(name: str) -> Any:
    # NaN/Infinity would re-encode as invalid JSON in the arguments string.
    raise ValueError(name)


def _escape(text: str) -> str:
    # JSON escapes character by character, so escaped pieces concatenate to the escaped whole.
    return json.dumps(text, ensure_ascii=False)[1:-1]


def qwen3_coder_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALL_START, TOOL_CALL_END, Qwen3CoderParser)
