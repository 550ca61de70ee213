"""Streams calls written as JSON objects `{"name": str, "arguments"|"parameters": {…}}`, shared by
the hermes, llama-3 JSON and mistral list forms.

The arguments string a call carries is the raw text of its arguments object, exactly as the
model wrote it (checked to be JSON as it arrives), not a re-encoding of the parsed object. That is
what lets the arguments stream: every character can go out as it is decoded, and the pieces the
client concatenates equal the string the non-streaming answer holds, character for character. A
re-encoded string (json.dumps: its own spacing, escapes and number forms) could only be produced
once the whole object had been read. Both are valid JSON for the same object, so nothing is lost.
Arguments given as a JSON *string* (some templates render them so) are decoded instead, which needs
the whole string: that one form goes out in one piece when the string ends.
"""

from __future__ import annotations

import json

from api.pipeline.tools.base import CallParser
from api.pipeline.tools.json_scan import JSON_WHITESPACE, JsonScanner, MarkupError

ARGUMENT_KEYS = ("arguments", "parameters")  # "parameters": llama-3's name for them


class JsonCallParser(CallParser):
    """Call objects back to back (separated by whitespace or ';'), or with `lists`, also JSON
    arrays of them.

    A call's header goes out once its name is read and its arguments have begun (or its object
    closed without any: then they are "{}"), so a block that breaks off earlier is still prose.
    Arguments that come before the name are held until it comes.
    """

    def __init__(self, *, lists: bool) -> None:
        super().__init__()
        self._lists = lists
        self._state = "between"
        self._in_list = False
        self._scanner = JsonScanner()
        self._raw = ""  # the key, name or string arguments being read
        self._key = ""
        self._name: str | None = None
        self._arguments = "none"  # "none" | "object" (being read) | "done"
        self._pending = ""  # arguments read before the name

    def _consume(self, text: str) -> None:
        i = 0
        while i < len(text):
            i = getattr(self, f"_on_{self._state}")(text, i)

    def _end(self, *, closed: bool) -> None:
        if self.in_call and self._arguments == "done":
            self._close()  # only the object's own `}` is missing
        elif self.in_call or self._state not in ("between", "list_first", "list_next", "list_item"):
            raise MarkupError("the call breaks off")

    # -- between calls

    def _on_between(self, text: str, i: int) -> int:
        c = text[i]
        if c.isspace() or c == ";":
            return i + 1
        if c == "{":
            return self._open_object(text, i, in_list=False)
        if c == "[" and self._lists:
            self._state = "list_first"
            return i + 1
        return self._between_other(text, i)

    def _between_other(self, text: str, i: int) -> int:
        raise MarkupError(f"unexpected {text[i]!r} between tool calls")

    def _on_list_first(self, text: str, i: int) -> int:
        return self._list_step(text, i, {"]": "between", "{": None})

    def _on_list_next(self, text: str, i: int) -> int:
        return self._list_step(text, i, {",": "list_item", "]": "between"})

    def _on_list_item(self, text: str, i: int) -> int:
        return self._list_step(text, i, {"{": None})

    def _list_step(self, text: str, i: int, moves: dict[str, str | None]) -> int:
        c = text[i]
        if c in JSON_WHITESPACE:
            return i + 1
        if c not in moves:
            raise MarkupError(f"unexpected {c!r} in a list of tool calls")
        target = moves[c]
        if target is None:
            return self._open_object(text, i, in_list=True)
        self._state = target
        return i + 1

    # -- one call object

    def _open_object(self, text: str, i: int, *, in_list: bool) -> int:
        self._in_list = in_list
        self._name, self._arguments, self._pending = None, "none", ""
        self._state = "key_or_close"
        return i + 1

    def _on_key_or_close(self, text: str, i: int) -> int:
        if text[i] == "}":
            return self._close_object(i)
        return self._on_key(text, i)

    def _on_key(self, text: str, i: int) -> int:
        c = text[i]
        if c in JSON_WHITESPACE:
            return i + 1
        if c != '"':
            raise MarkupError(f"unexpected {c!r} where a key starts")
        return self._read_value(text, i, "key_string")

    def _on_key_string(self, text: str, i: int) -> int:
        end = self._read(text, i)
        if end >= 0:
            self._key = json.loads(self._raw)
            self._state = "colon"
        return len(text) if end < 0 else end

    def _on_colon(self, text: str, i: int) -> int:
        c = text[i]
        if c == ":":
            self._state = "value"
        elif c not in JSON_WHITESPACE:
            raise MarkupError(f"unexpected {c!r} where ':' belongs")
        return i + 1

    def _on_value(self, text: str, i: int) -> int:
        c = text[i]
        if c in JSON_WHITESPACE:
            return i + 1
        if self._key == "name":
            if self._name is not None or c != '"':
                raise MarkupError("a call needs one name, a string")
            return self._read_value(text, i, "name")
        if self._key in ARGUMENT_KEYS:
            if self._arguments != "none" or c not in '{"':
                raise MarkupError("a call's arguments must be one object (or a string holding one)")
            if c == '"':
                return self._read_value(text, i, "string_arguments")
            self._arguments = "object"
            if self._name is not None:
                self._start(self._name)
            self._scanner = JsonScanner()
            self._state = "object_arguments"
            return i
        return self._read_value(text, i, "skip")

    def _on_name(self, text: str, i: int) -> int:
        end = self._read(text, i)
        if end >= 0:
            self._name = json.loads(self._raw)
            if self._arguments == "done":
                self._start(self._name, self._pending)
            self._state = "next"
        return len(text) if end < 0 else end

    def _on_object_arguments(self, text: str, i: int) -> int:
        end = self._scanner.feed(text, i)
        piece = text[i:] if end < 0 else text[i:end]
        if self.in_call:
            self._args(piece)
        else:
            self._pending += piece
        if end >= 0:
            self._arguments, self._state = "done", "next"
        return len(text) if end < 0 else end

    def _on_string_arguments(self, text: str, i: int) -> int:
        end = self._read(text, i)
        if end >= 0:
            decoded = json.loads(self._raw)
            arguments = decoded if decoded.strip() else "{}"
            if not is_json_object(arguments):
                raise MarkupError("the arguments string does not hold a JSON object")
            self._arguments, self._state = "done", "next"
            if self._name is not None:
                self._start(self._name, arguments)
            else:
                self._pending = arguments
        return len(text) if end < 0 else end

    def _on_skip(self, text: str, i: int) -> int:
        end = self._read(text, i)
        if end >= 0:
            self._state = "next"
        return len(text) if end < 0 else end

    def _on_next(self, text: str, i: int) -> int:
        c = text[i]
        if c == ",":
            self._state = "key"
        elif c == "}":
            return self._close_object(i)
        elif c not in JSON_WHITESPACE:
            raise MarkupError(f"unexpected {c!r} after a value")
        return i + 1

    def _close_object(self, i: int) -> int:
        if self._name is None:
            raise MarkupError("not a tool call: no name")
        if not self.in_call:
            self._start(self._name, self._pending if self._arguments == "done" else "{}")
        self._close()
        self._state = "list_next" if self._in_list else "between"
        return i + 1

    # -- reading one value whole (keys, names, string arguments, values of other keys)

    def _read_value(self, text: str, i: int, state: str) -> int:
        self._scanner, self._raw, self._state = JsonScanner(), "", state
        return i

    def _read(self, text: str, i: int) -> int:
        """Feed the value being read; the index past it once it is complete, else -1."""
        end = self._scanner.feed(text, i)
        if self._state != "skip":
            self._raw += text[i:] if end < 0 else text[i:end]
        return end


def is_json_object(text: str) -> bool:
    """Whether `text` is exactly one JSON object (surrounding whitespace aside), NaN / Infinity
    not being JSON. One C parse: the whole string is at hand, so no per-character scan."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, _NotJson):
        return False
    except (RecursionError, ValueError):  # nested past json's recursion limit, or a too-long integer
        return _scanned_object(text)  # (still JSON: the scanner has neither limit)
    return isinstance(value, dict)


class _NotJson(Exception):
    pass


def _reject_constant(name: str) -> None:
    raise _NotJson(name)


def _scanned_object(text: str) -> bool:
    scanner = JsonScanner()
    try:
        end = scanner.feed(text)
    except MarkupError:
        return False
    return end >= 0 and text.lstrip(JSON_WHITESPACE).startswith("{") and not text[end:].strip(JSON_WHITESPACE)
