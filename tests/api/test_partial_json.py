"""api/partial_json.py reads an unfinished tool_use input as the anthropic SDK does: checked
against jiter's partial mode (what the SDK's stream accumulation calls) on every prefix of
generated JSON objects."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.partial_json import MAX_DEPTH, json_object, partial_object

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


def depth_of(value: object) -> int:
    depth = 0
    while isinstance(value, (dict, list)) and value:
        depth, value = depth + 1, next(iter(value.values())) if isinstance(value, dict) else value[0]
    return depth + 1


def test_deep_nesting_does_not_exhaust_the_stack():
    value = partial_object('{"a": ' + "[" * 100_000)  # a model may write that; no RecursionError
    assert depth_of(value) == MAX_DEPTH  # nothing deeper is rebuilt: json.dumps can encode it
    json.dumps(value)


@pytest.mark.parametrize("text", ['{"a": ' + "[" * 2_000, '{"a": ' + "[" * 600 + "]" * 600 + "}"])
def test_json_object_is_never_deeper_than_json_dumps_can_go(text):
    value = json_object(text)
    assert depth_of(value) == MAX_DEPTH
    assert json.loads(json.dumps(value)) == value


def test_json_object_of_whole_json_is_json_loads(monkeypatch):
    big = {"rows": [{"id": i, "name": f"row {i}", "tags": ["a", "b"], "score": i / 7} for i in range(4_000)]}
    text = json.dumps(big)
    assert len(text) > 200_000

    def no_partial_reading(text: str) -> dict:
        raise AssertionError("whole JSON is parsed by json.loads, not walked character by character")

    monkeypatch.setattr("api.partial_json.partial_object", no_partial_reading)
    assert json_object(text) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"city": "Paris", "unit": "cel', {"city": "Paris"}),  # cut: the partial reading
        ('{"a": 1} trailing', {"a": 1}),
        ("[1]", {}),
        ('{"a": NaN}', {}),  # not JSON: never a NaN that would encode as invalid JSON
        ('{"a": 1, "b": Infinity}', {}),
        ('{"a": 1e400}', {}),  # would encode as Infinity
        ('{"a": 1, "b": 1e400', {}),  # the partial reading too
        ('{"a": "x\\ud800y", "\\udc00": ["\\ud83d\\ude00"]}', {"a": "x\ufffdy", "\ufffd": ["\U0001f600"]}),
        ('{"a": "x\\ud800', {}),
    ],
)
def test_json_object_examples(text, expected):
    value = json_object(text)
    assert value == expected
    json.dumps(value, ensure_ascii=False).encode()  # always encodable, as UTF-8 too
