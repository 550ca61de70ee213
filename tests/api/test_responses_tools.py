"""Codex-shaped Responses tools (api/responses/tools.py): custom tools (free-form input, a grammar
format) and namespace groups, as templates see them, as input items re-feed them, as the encoder
answers them (custom_tool_call items, custom_tool_call_input events, a namespace's function_call
with its `namespace`), and a forced grammar tool's constraint. Events and objects are validated
with the openai SDK's models."""

from __future__ import annotations

import json

import pydantic
import pytest

from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart
from api.responses.encode import ResponseMeta, ResponsesStream
from api.responses.items import output_to_input, stored_input
from api.responses.tools import InputStream, custom_input, tool_set
from api.responses.translate import input_items, responses_request
from model.text import grammar

openai = pytest.importorskip("openai")
from openai.types.responses import Response as SdkResponse  # noqa: E402
from openai.types.responses import ResponseInputItem, ResponseItem, ResponseStreamEvent  # noqa: E402

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM = pydantic.TypeAdapter(ResponseItem)
INPUT_ITEM = pydantic.TypeAdapter(ResponseInputItem)

PATCH_GRAMMAR = 'start: "*** Begin Patch" LF line+ "*** End Patch" LF?\nline: "+" /[a-z ]*/ LF\n%import common.LF\n'
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "note"},
    ],
}
TOOLS = [EXEC, APPLY_PATCH, AGENTS, {"type": "web_search"}]
PATCH = '*** Begin Patch\n*** Add File: a.txt\n+say "hi" \\ é 😀\n*** End Patch\n'


def meta(**body) -> ResponseMeta:
    return ResponseMeta({"input": "x", **body}, model="m", instructions=None, previous_response_id=None, store=True)


def events_of(data: bytes) -> list[dict]:
    events = [json.loads(f.split("data: ", 1)[1]) for f in data.decode().split("\n\n") if f.strip()]
    for event in events:
        EVENT.validate_python(event)
    return events


def test_templates_see_custom_tools_as_one_input_string_and_namespaces_as_dotted_names():
    tools = tool_set(TOOLS).template_tools()
    names = [tool["function"]["name"] for tool in tools]
    assert names == ["exec_command", "apply_patch", "multi_agent_v1.close_agent", "multi_agent_v1.note"]
    patch = tools[1]["function"]
    assert patch["parameters"]["required"] == ["input"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    assert patch["description"].startswith("Edit files.") and PATCH_GRAMMAR in patch["description"]
    toolset = tool_set(TOOLS)
    assert toolset.resolve("multi_agent_v1.close_agent").namespace == "multi_agent_v1"
    assert toolset.resolve("close_agent").name == "close_agent"  # a bare inner name, unique
    assert toolset.resolve("web_search") is None


@pytest.mark.parametrize(
    "tools",
    [
        [APPLY_PATCH, APPLY_PATCH],
        [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "ebnf", "definition": "a"}}],
        [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark"}}],
        [{"type": "custom"}],
        [{"type": "namespace", "name": "n"}],
    ],
)
def test_malformed_tools_are_400s_naming_tools(tools):
    with pytest.raises(ApiError) as raised:
        responses_request({"input": "x", "tools": tools}, input_items("x"), None, vocab_size=None)
    assert raised.value.status == 400 and raised.value.param == "tools"


def test_custom_and_namespaced_calls_in_the_input_reach_the_template_as_calls():
    items = [
        {"type": "message", "role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Success."},
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_2", "output": "closed"},
    ]
    for item in items:
        INPUT_ITEM.validate_python(item)
    request = responses_request({"input": items, "tools": TOOLS}, items, None, vocab_size=None)
    user, patching, patched, closing, closed = request.prompt.messages
    calls = [(c["function"]["name"], c["function"]["arguments"]) for m in (patching, closing) for c in m["tool_calls"]]
    assert calls == [("apply_patch", {"input": PATCH}), ("multi_agent_v1.close_agent", {})]
    assert patched == {"role": "tool", "tool_call_id": "call_1", "content": "Success."}
    assert closed["tool_call_id"] == "call_2"
    stored = stored_input(items)
    for item in stored:
        ITEM.validate_python(item)
    assert [i["type"] for i in stored] == [i["type"] for i in items]
    assert stored[1]["input"] == PATCH and stored[3]["namespace"] == "multi_agent_v1"
    assert stored_input(stored) == stored  # idempotent


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_the_input_decodes_as_its_json_pieces_arrive_whatever_the_cuts(ensure_ascii):
    arguments = json.dumps({"input": PATCH}, ensure_ascii=ensure_ascii)
    cuts = [[arguments[:i], arguments[i:]] for i in range(len(arguments) + 1)] + [list(arguments)]
    for pieces in cuts:
        stream = InputStream()
        deltas = [stream.feed(piece) for piece in pieces]
        whole, rest = stream.finish()
        assert "".join(deltas) + rest == whole == PATCH, pieces


def test_an_input_that_is_not_an_input_string_is_the_one_value_or_the_text():
    assert custom_input('{"patch": "p"}') == "p"
    assert custom_input("not json") == "not json"
    stream = InputStream()
    assert stream.feed('{"patch": ') == "" and stream.feed('"p"}') == ""
    assert stream.finish() == ("p", "p")  # the close sends it as its one delta


def test_a_custom_call_streams_as_custom_tool_call_input_events():
    stream = ResponsesStream(meta(tools=TOOLS), tools=tool_set(TOOLS))
    arguments = json.dumps({"input": PATCH})
    data = stream.start()
    data += stream.add([ToolCallStart(0, "call_ab12", "apply_patch")])
    data += stream.add([ToolCallDelta(0, arguments[i : i + 7]) for i in range(0, len(arguments), 7)])
    data += stream.add([ToolCallStart(1, "call_cd34", "multi_agent_v1.close_agent"), ToolCallDelta(1, "{}")])
    data += stream.add([ToolCallsEvent((ToolCall("call_ab12", "apply_patch", arguments),))])
    closing, final = stream.finish(finish_reason="tool_calls", openai_usage={}, reasoning="")
    events = events_of(data + closing)
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done["input"] == PATCH and len(deltas) > 3
    patch, closed = final["output"]
    assert patch == {
        "id": "ctc_ab12",
        "type": "custom_tool_call",
        "call_id": "call_ab12",
        "name": "apply_patch",
        "input": PATCH,
        "status": "completed",
    }
    assert closed["type"] == "function_call" and (closed["name"], closed["namespace"]) == (
        "close_agent",
        "multi_agent_v1",
    )
    parsed = SdkResponse.model_validate(final)
    assert parsed.output[0].type == "custom_tool_call" and parsed.output[1].namespace == "multi_agent_v1"
    assert [t.type for t in parsed.tools] == ["function", "custom", "namespace"]
    # A continuation re-feeds both calls as they were answered.
    assert [(i["type"], i["id"]) for i in output_to_input(final["output"])] == [
        ("custom_tool_call", "ctc_ab12"),
        ("function_call", closed["id"]),
    ]


def test_a_grammar_forced_custom_tool_constrains_the_whole_answer_which_is_its_input():
    choice = {"type": "custom", "name": "apply_patch"}
    body = {"input": "x", "tools": TOOLS, "tool_choice": choice}
    request = responses_request(body, input_items("x"), None, vocab_size=None)
    if grammar.available():
        assert request.constraint is not None and request.constraint.constraint.spec == PATCH_GRAMMAR
    regex = {
        "type": "custom",
        "name": "pick",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[ab]{2}"},
    }
    forced = responses_request(
        {"input": "x", "tools": [regex], "tool_choice": {"type": "custom", "name": "pick"}},
        input_items("x"),
        None,
        vocab_size=None,
    )
    if grammar.available():
        assert forced.constraint is not None and forced.constraint.constraint.kind == "regex"
        bad = {**APPLY_PATCH, "format": {**APPLY_PATCH["format"], "definition": "start: ((("}}
        with pytest.raises(ApiError) as raised:
            responses_request({**body, "tools": [bad]}, input_items("x"), None, vocab_size=None)
        assert raised.value.param == "tools"
    with pytest.raises(ApiError) as raised:
        responses_request(
            {**body, "tool_choice": {"type": "custom", "name": "exec_command"}}, input_items("x"), None, vocab_size=None
        )
    assert raised.value.param == "tool_choice"

    stream = ResponsesStream(meta(tools=TOOLS), tools=tool_set(TOOLS), forced=tool_set(TOOLS).resolve("apply_patch"))
    data = stream.start() + stream.add([TextDelta("content", PATCH[:10]), TextDelta("content", PATCH[10:])])
    closing, final = stream.finish(finish_reason="stop", openai_usage={}, reasoning="")
    events = events_of(data + closing)
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == PATCH
    [call] = final["output"]
    assert call["type"] == "custom_tool_call" and call["input"] == PATCH and call["call_id"].startswith("call_")
