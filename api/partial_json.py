"""The object an unfinished JSON text already describes, read as the anthropic SDK reads a
streamed tool_use block's `input_json_delta` pieces (jiter's partial mode).

A Messages answer's tool_use `input` is an object, never text, so a call cut by max_tokens (or
whose markup broke after its header) needs one: the whole answer gives the object its streamed
pieces already describe, which is what the SDK rebuilds from the stream. Open objects and
arrays are closed; a string, number or literal the text ends inside is dropped, and with it the
key it belonged to (as is a key still waiting for its value). Iterative, and nothing deeper
than MAX_DEPTH is rebuilt (what lies above it is kept): a deep nesting the model wrote can
exhaust neither this stack nor `json.dumps`'s.

`json_object` is the reading for a whole answer: `json.loads` (C) when the text is whole JSON,
the partial reading only when it is not, so a long finished call costs a parse, not a Python
walk of every character.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 256  # nesting rebuilt at most: far beyond real arguments, far below the recursion limit

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")
_LITERALS = {"true": True, "false": False, "null": None}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _Cut(Exception):
    """The text ends inside a scalar: it (and a key waiting for it) is dropped."""


def partial_object(text: str) -> dict[str, Any]:
    """The object `text` (a JSON object, or the start of one) describes so far; {} when it does
    not start as an object or breaks off into something that is not JSON."""
    try:
        value = _read(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def json_object(text: str) -> dict[str, Any]:
    """`partial_object(text)`, parsed by `json.loads` when `text` is whole JSON; never what
    JSON cannot encode: NaN / Infinity (and 1e400) are not read as numbers, nesting deeper than
    MAX_DEPTH is cut there, and a lone UTF-16 surrogate (`\\ud800`) becomes U+FFFD."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite_float)
    except (ValueError, RecursionError):  # cut, broken, NaN / 1e400, a huge integer, too deep for json
        value = partial_object(text)
    else:
        if not isinstance(value, dict):
            return {}
        if not _within_depth(text, value):
            value = partial_object(text)  # (rebuilds only down to MAX_DEPTH)
    return _without_lone_surrogates(value) if _SURROGATE_ESCAPE.search(text) else value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(token: str) -> float:
    value = float(token)
    if math.isinf(value):  # 1e400: JSON's grammar, but it would encode as Infinity
        raise ValueError(f"number {token[:32]} is out of range")
    return value


def _within_depth(text: str, value: Any) -> bool:
    if text.count("{") + text.count("[") <= MAX_DEPTH:  # (C-speed: no walk for usual arguments)
        return True
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def _without_lone_surrogates(value: Any) -> Any:
    """`value` with every lone surrogate in its strings replaced (they cannot be UTF-8 encoded).
    Recursive: `value` is at most MAX_DEPTH deep."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_lone_surrogates(item) for item in value]
    return value


def _read(text: str) -> Any:
    root: Any = None
    stack: list[dict[str, Any] | list[Any]] = []  # the open containers
    key: str | None = None  # the innermost object's key whose value comes next
    expect = "value"  # value | key | colon | comma (or a close: "value" in a list, "key" in an object)
    i, n = 0, len(text)

    def add(value: Any) -> None:
        nonlocal root, key
        if not stack:
            root = value
        elif isinstance(stack[-1], list):
            stack[-1].append(value)
        else:
            assert key is not None
            stack[-1][key] = value
            key = None

    try:
        while True:
            i = _WHITESPACE.match(text, i).end()  # type: ignore[union-attr]  # (always matches)
            if i >= n:
                break
            c = text[i]
            if expect == "comma":
                if c == "," and stack:
                    expect, i = ("key" if isinstance(stack[-1], dict) else "value"), i + 1
                    continue
                if c not in "}]":
                    raise ValueError(f"unexpected {c!r} after a value")
            if c in "}]":
                if not stack or isinstance(stack[-1], dict) != (c == "}") or expect == "colon":
                    raise ValueError(f"unexpected {c!r}")
                stack.pop()
                i += 1
                if not stack:
                    break  # the whole value; whatever follows is not part of it
                expect = "comma"
            elif expect == "key":
                if c != '"':
                    raise ValueError(f"unexpected {c!r} where a key starts")
                key, i = _string(text, i)
                expect = "colon"
            elif expect == "colon":
                if c != ":":
                    raise ValueError(f"unexpected {c!r} where ':' belongs")
                expect, i = "value", i + 1
            elif c in "{[":
                if len(stack) >= MAX_DEPTH:
                    break  # deeper than is rebuilt: the value stops here, as if cut
                container: dict[str, Any] | list[Any] = {} if c == "{" else []
                add(container)  # an open container counts with what it holds so far
                stack.append(container)
                expect, i = ("key" if c == "{" else "value"), i + 1
            else:
                value, i = _scalar(text, i)
                add(value)
                if not stack:
                    break
                expect = "comma"
    except _Cut:
        pass
    return root


def _scalar(text: str, i: int) -> tuple[Any, int]:
    c = text[i]
    if c == '"':
        return _string(text, i)
    if c == "-" or c.isdigit():
        return _number(text, i)
    for word, value in _LITERALS.items():
        if text.startswith(word, i):
            return value, i + len(word)
        if word.startswith(text[i:]):
            raise _Cut
    raise ValueError(f"unexpected {c!r} where a value starts")


def _string(text: str, i: int) -> tuple[str, int]:
    match = _STRING.match(text, i)
    if match is None:
        raise _Cut  # no closing quote yet
    value = json.loads(match.group())
    assert isinstance(value, str)
    return value, match.end()


def _number(text: str, i: int) -> tuple[int | float, int]:
    end = _NUMBER_CHARS.match(text, i).end()  # type: ignore[union-attr]  # (always matches)
    match = _NUMBER.match(text, i)
    if match is None or match.end() != end:
        if end == len(text):
            raise _Cut  # "-", "1.", "1e+": a number the text ends inside
        raise ValueError("not a JSON number")
    token = match.group()
    return (_finite_float(token) if match.group(1) or match.group(2) else int(token)), end
