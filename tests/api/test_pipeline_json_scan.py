"""The incremental JSON checker the tool-call parsers stream arguments through."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.pipeline.tools.json_scan import JsonScanner, MarkupError


def _reject(name: str):
    raise ValueError(name)


def loads_ok(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_reject)
    except ValueError:
        return False
    return True


def scan(text: str, cuts: list[int] = ()) -> tuple[str, int] | str:
    """("end", index) / "open-complete" / "open" / "error", feeding `text` cut at `cuts`."""
    scanner = JsonScanner()
    bounds = [0, *sorted(cuts), len(text)]
    try:
        for a, b in zip(bounds, bounds[1:]):
            end = scanner.feed(text[a:b])
            if end >= 0:
                return ("end", a + end)
    except MarkupError:
        return "error"
    return "open-complete" if scanner.complete() else "open"


def accepts(text: str) -> bool:
    result = scan(text)
    if isinstance(result, tuple):
        return not text[result[1] :].strip(" \t\n\r")
    return result == "open-complete"


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2.5e-3, -0, true, null, "x\\u00e9\\n"]}', "  42 ", '""', "[]", "{}", '"\\ud800"', "1E+5"],
)
def test_accepts_what_json_loads_accepts(text):
    assert accepts(text) and loads_ok(text)


@pytest.mark.parametrize(
    "text",
    ["01", "-", "1.", "1e", '"a\nb"', '{"a":1,}', "[1,]", '{"a" 1}', "nul", "NaN", "-Infinity", "[1}", '"\\x"', "3 4"],
)
def test_refuses_what_json_loads_refuses(text):
    assert not accepts(text) and not loads_ok(text)


def test_a_value_ends_where_its_text_does():
    assert scan('{"a": "}"} tail') == ("end", 10)
    assert scan("[1, [2]]]") == ("end", 8)
    assert scan("12 ") == ("end", 2)  # a number ends at the character after it, not consumed


_JSONISH = st.text(alphabet='{}[]",:0123456789.-+eE \n\ttruefalsnl\\u\x01a', max_size=14)


@settings(max_examples=500, deadline=None)
@given(_JSONISH)
def test_agrees_with_json_loads(text):
    assert accepts(text) == loads_ok(text)


@settings(max_examples=300, deadline=None)
@given(_JSONISH, st.lists(st.integers(0, 20), max_size=4))
def test_any_split_gives_the_same_answer(text, cuts):
    assert scan(text, [c % (len(text) + 1) for c in cuts]) == scan(text)
