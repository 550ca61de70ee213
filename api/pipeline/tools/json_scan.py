"""An incremental JSON checker: says where one value ends, as its text arrives in pieces.

Tool-call arguments are streamed as the model writes them, so their end (and whether they are
JSON at all) must be found without re-reading the text so far on every token: the scanner keeps
its state between pieces and looks at each character once (a string's body in one regex jump).
"""

from __future__ import annotations

import re

JSON_WHITESPACE = " \t\n\r"
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_NUMBER_ENDS = ("zero", "int", "frac", "exp_int")  # number states where the number may stop


class MarkupError(ValueError):
    """Text that cannot continue the markup being parsed."""


class JsonScanner:
    """Checks one JSON value character by character, as json.loads (strict) accepts it, except
    NaN / Infinity, which would not re-encode as JSON; leading whitespace is skipped.

    `feed` returns the index just past the value once it is complete, else -1 (all consumed).
    A top-level number ends only at the next character, which is not consumed; `complete` says
    whether the value would be whole if the text stopped here.
    """

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._state = "value"
        self._literal = ""  # what is left of true / false / null
        self._hex = 0  # \uXXXX digits still expected
        self._key = False  # the string being read is an object key

    @property
    def done(self) -> bool:
        return self._state == "done"

    def complete(self) -> bool:
        return self._state == "done" or (not self._stack and self._state in _NUMBER_ENDS)

    def feed(self, text: str, position: int = 0) -> int:
        """Consume `text` from `position`; raises MarkupError at the first character that
        cannot continue the value."""
        i, n = position, len(text)
        while i < n:
            state = self._state
            if state == "string":
                match = _STRING_STOP.search(text, i)
                if match is None:
                    return -1
                i = match.start()
                if text[i] == '"':
                    i += 1
                    if self._key:
                        self._state = "colon"
                    elif self._after_value():
                        return i
                elif text[i] == "\\":
                    self._state = "escape"
                    i += 1
                else:
                    raise MarkupError("control character in a JSON string")
                continue
            if self._step(state, text[i]):
                i += 1
            if self._state == "done":  # (a number ends at the character after it, not consumed)
                return i
        return -1

    def _step(self, state: str, c: str) -> bool:
        """Advance on `c`; False when `c` was not consumed (it ended a number)."""
        if state in ("value", "value_or_close", "key_or_close", "key", "colon", "comma_or_close"):
            if c in JSON_WHITESPACE:
                return True
        if state == "value_or_close" and c == "]":
            self._close(c)
        elif state in ("value", "value_or_close"):
            self._start_value(c)
        elif state in ("key_or_close", "key") and c == '"':
            self._state, self._key = "string", True
        elif state == "key_or_close" and c == "}":
            self._close(c)
        elif state == "colon" and c == ":":
            self._state = "value"
        elif state == "comma_or_close" and c == ",":
            self._state = "key" if self._stack[-1] == "{" else "value"
        elif state == "comma_or_close" and c in "}]":
            self._close(c)
        elif state == "escape" and c in _ESCAPES:
            self._state = "string"
        elif state == "escape" and c == "u":
            self._state, self._hex = "hex", 4
        elif state == "hex" and c in _HEX:
            self._hex -= 1
            if not self._hex:
                self._state = "string"
        elif state == "literal" and c == self._literal[0]:
            self._literal = self._literal[1:]
            if not self._literal:
                self._after_value()
        elif state in ("minus", "zero", "int", "dot", "frac", "exp", "exp_sign", "exp_int"):
            return self._number(state, c)
        else:
            raise MarkupError(f"unexpected {c!r} in JSON")
        return True

    def _start_value(self, c: str) -> None:
        if c in "{[":
            self._stack.append(c)
            self._state = "key_or_close" if c == "{" else "value_or_close"
        elif c == '"':
            self._state, self._key = "string", False
        elif c == "-":
            self._state = "minus"
        elif c in _DIGITS:
            self._state = "zero" if c == "0" else "int"
        elif c in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[c]
        else:
            raise MarkupError(f"unexpected {c!r} where a JSON value starts")

    def _number(self, state: str, c: str) -> bool:
        digit = c in _DIGITS
        if state == "minus" and digit:
            self._state = "zero" if c == "0" else "int"
        elif state in ("int", "frac", "exp_int") and digit:
            pass
        elif state in ("zero", "int") and c == ".":
            self._state = "dot"
        elif state == "dot" and digit:
            self._state = "frac"
        elif state in ("zero", "int", "frac") and c in "eE":
            self._state = "exp"
        elif state == "exp" and c in "+-":
            self._state = "exp_sign"
        elif state in ("exp", "exp_sign") and digit:
            self._state = "exp_int"
        elif state in _NUMBER_ENDS:
            self._after_value()  # the number ended before `c`, which the caller reads again
            return False
        else:
            raise MarkupError(f"unexpected {c!r} in a JSON number")
        return True

    def _close(self, c: str) -> None:
        if not self._stack or self._stack.pop() != ("{" if c == "}" else "["):
            raise MarkupError(f"unbalanced {c!r} in JSON")
        self._after_value()

    def _after_value(self) -> bool:
        self._state = "comma_or_close" if self._stack else "done"
        return self._state == "done"
