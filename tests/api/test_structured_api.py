"""Request fields → Constraint (api/structured.py): precedence, shapes, 400s, the Warning fallback."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from api import structured  # noqa: E402
from api.errors import ApiError  # noqa: E402
from model.engine.params import Constraint  # noqa: E402
from model.text import grammar  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def c(body, tool_format=None):
    """The constraint an OpenAI body asks for, once the model's tool-call format is known."""
    request = structured.body_constraint(body)
    return None if request is None else request.for_tool_format(tool_format)


def test_no_fields_and_text_mean_no_constraint():
    assert c({}) is None
    assert c({"response_format": {"type": "text"}}) is None
    assert c({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}) is None


def test_response_format_kinds():
    assert c({"response_format": {"type": "json_object"}}) == Constraint("json_object")
    got = c(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}
    )
    assert got.kind == "json_schema" and json.loads(got.spec) == SCHEMA and got.strict
    got = c({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert not got.strict


def test_guided_fields_and_structured_outputs():
    assert c({"guided_regex": "a+"}) == Constraint("regex", "a+")
    assert c({"guided_choice": ["x", "y"]}) == Constraint("choice", '["x", "y"]')
    assert c({"guided_grammar": 'root ::= "a"'}) == Constraint("grammar", 'root ::= "a"')
    assert c({"guided_json": json.dumps(SCHEMA)}).kind == "json_schema"
    assert c({"structured_outputs": {"regex": "b+"}}) == Constraint("regex", "b+")
    assert c({"structured_outputs": {"choice": ["p"]}}) == Constraint("choice", '["p"]')
    assert c({"structured_outputs": {"json": SCHEMA}}).kind == "json_schema"


def test_precedence():
    # guided_grammar > json_schema > json_object > structured_outputs > guided_regex > guided_choice
    every = {
        "guided_grammar": 'root ::= "g"',
        "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        "structured_outputs": {"regex": "s"},
        "guided_regex": "r",
        "guided_choice": ["c"],
    }
    assert c(every).kind == "grammar"
    del every["guided_grammar"]
    assert c(every).kind == "json_schema"
    every["response_format"] = {"type": "json_object"}
    assert c(every).kind == "json_object"
    del every["response_format"]
    assert c(every) == Constraint("regex", "s")
    del every["structured_outputs"]
    assert c(every) == Constraint("regex", "r")
    del every["guided_regex"]
    assert c(every).kind == "choice"


def test_responses_text_format():
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    assert structured.response_format_from_text_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
    }
    got = c({"text": {"format": fmt}})
    assert got.kind == "json_schema" and got.strict
    assert c({"text": {"format": {"type": "text"}}}) is None


def test_forced_tool_call():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "g"}},
    ]
    got = c({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}, "guided_regex": "x"})
    assert got.kind == "tool_call"
    spec = json.loads(got.spec)
    assert spec == {"format": "hermes", "mode": "one", "tools": [{"name": "f", "parameters": SCHEMA, "strict": False}]}
    got = c({"tools": tools, "tool_choice": "required"}, tool_format="llama3_json")
    assert [t["name"] for t in json.loads(got.spec)["tools"]] == ["f", "g"]
    assert json.loads(got.spec)["format"] == "llama3_json"
    assert json.loads(got.spec)["mode"] == "many"  # required, parallel calls allowed: one or more
    single = c({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(single.spec)["mode"] == "one"
    # Responses' flat tool shape
    got = c(
        {
            "tools": [{"type": "function", "name": "h", "parameters": SCHEMA}],
            "tool_choice": {"type": "function", "name": "h"},
        }
    )
    assert json.loads(got.spec)["tools"][0]["name"] == "h"
    assert json.loads(c({"tools": tools, "tool_choice": "required"}, tool_format="qwen3_coder").spec)["format"] == (
        "qwen3_coder"
    )
    # A markup without a grammar falls back on the other constraint fields.
    body = {"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert c(body, tool_format="pythonic") == Constraint("json_object")
    assert c(body).kind == "tool_call"  # ... which a forced call otherwise wins over
    with pytest.raises(ApiError) as e:
        c({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert e.value.status == 400


def test_strict_tools_under_auto_get_a_lazy_grammar():
    strict = {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}
    loose = {"type": "function", "function": {"name": "g", "parameters": SCHEMA}}
    for choice in ({}, {"tool_choice": "auto"}):
        got = c({"tools": [strict, loose], **choice})
        spec = json.loads(got.spec)
        assert got.kind == "tool_call" and spec["mode"] == "lazy"
        assert [(t["name"], t["strict"]) for t in spec["tools"]] == [("f", True), ("g", False)]
    assert c({"tools": [loose], "tool_choice": "auto"}) is None  # no strict tool: free, as before
    assert c({"tools": [strict], "tool_choice": "none"}) is None
    # another output constraint wins; a markup without a marker cannot be constrained lazily
    assert c({"tools": [strict], "response_format": {"type": "json_object"}}) == Constraint("json_object")
    assert c({"tools": [strict]}, tool_format="llama3_json") is None


def test_tool_call_grammar_per_format():
    spec = {"tools": [{"name": "f", "parameters": SCHEMA}]}
    for fmt in grammar.TOOL_FORMATS:
        grammar.validate(Constraint("tool_call", json.dumps({**spec, "format": fmt})))


# What `openai.pydantic_function_tool` sends for a nested model: refs into the schema's own `$defs`
# (and here properties named like keywords, whose refs are refs all the same).
REF_SCHEMA = {
    "type": "object",
    "properties": {"loc": {"$ref": "#/$defs/Loc"}, "const": {"$ref": "#/$defs/Loc"}, "enum": {"$ref": "#"}},
    "required": ["loc"],
    "$defs": {"Loc": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_call_with_local_refs_in_its_schema(choice):
    tools = [{"type": "function", "function": {"name": n, "parameters": REF_SCHEMA}} for n in ("f", "g")]
    for fmt in (None, *grammar.TOOL_FORMATS):
        assert c({"tools": tools, "tool_choice": choice}, tool_format=fmt).kind == "tool_call"  # no 400


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "objectx"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "pattern": "[["}},
                }
            },
            "regex",
        ),
        ({"guided_regex": "a(b"}, "unclosed group"),
        ({"guided_grammar": "root ::= missing"}, "missing"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "must be an object"),
        ({"guided_choice": []}, "non-empty"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}}, "strict"),
    ],
)
def test_invalid_is_a_400_with_the_engine_message(body, needle):
    with pytest.raises(ApiError) as e:
        c(body)
    assert e.value.status == 400
    assert needle in e.value.message


def test_strict_rejects_unknown_formats_non_strict_ignores_them():
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    assert c({"response_format": rf}).kind == "json_schema"
    rf["json_schema"]["strict"] = True
    with pytest.raises(ApiError, match="no-such-format"):
        c({"response_format": rf})


def test_without_an_engine_requests_are_served_unconstrained(monkeypatch):
    monkeypatch.setattr(grammar, "_ll", None)
    assert not grammar.available()
    body = {"response_format": {"type": "json_object"}}
    assert structured.body_constraint(body) is None  # served, not enforced
    assert structured.not_enforced_warning(Constraint("json_object")) == (
        '299 - "response_format json_object not enforced: no grammar engine installed"'
    )
    monkeypatch.undo()
    assert c(body) == Constraint("json_object")
