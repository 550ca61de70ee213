"""api/partial_json.py reads an unfinished tool_use input as the anthropic SDK does: checked
against jiter's partial mode (what the SDK's stream accumulation calls) on every prefix of
generated JSON objects."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.partial_json import partial_object

jiter = pytest.importorskip("jiter")

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
)
OBJECTS = st.dictionaries(st.text(max_size=4), VALUES, max_size=4)


def sdk_reading(text: str) -> dict:
    """What the SDK's accumulation holds after these pieces: its start block's {} until one comes."""
    if not text:
        return {}
    value = jiter.from_json(text.encode(), partial_mode=True)
    return value if isinstance(value, dict) else {}


@settings(max_examples=150, deadline=None)
@given(OBJECTS, st.booleans(), st.booleans())
def test_every_prefix_reads_as_the_sdk_reads_it(value, ascii_only, compact):
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    assert partial_object(text) == value
    for end in range(len(text)):
        assert partial_object(text[:end]) == sdk_reading(text[:end]), text[:end]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"city": "Pa', {}),
        ('{"city": "Paris", "unit', {"city": "Paris"}),
        ('{"city": "Paris", "n": 1', {"city": "Paris", "n": 1}),
        ('{"a": [1, {"b": tr', {"a": [1, {}]}),
        ('{"a": 1.', {}),
        ('{"a": 1} trailing', {"a": 1}),
        ("", {}),
        ("[1, 2", {}),  # not an object
        ("{oops", {}),
        ('{"a": 1 "b": 2}', {}),
    ],
)
def test_examples(text, expected):
    assert partial_object(text) == expected


def test_deep_nesting_does_not_exhaust_the_stack():
    value = partial_object('{"a": ' + "[" * 100_000)  # a model may write that; no RecursionError
    depth, inner = 0, value["a"]
    while inner:
        depth, inner = depth + 1, inner[0]
    assert depth == 100_000 - 1
