"""Codex-shaped tools end to end through the official `openai` SDK's Responses client, over real
HTTP against the real stack serving tiny scripted checkpoints: a scripted call of a custom tool
comes back as a `custom_tool_call` item (whole and streamed, as `response.custom_tool_call_input`
events), a namespace's tool as a `function_call` with its `namespace`, and a custom tool forced
with a grammar answers an input its grammar matches, whatever the model would have said."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.live import TEXT_SCRIPT, live_server, scripted

openai = pytest.importorskip("openai")

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi there\n*** End Patch\n"
CUSTOM_SCRIPT = (
    "I will patch.",
    "<tool_call>",
    json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}),
    "</tool_call>",
)
NAMESPACE_SCRIPT = (
    "<tool_call>",
    json.dumps({"name": "multi_agent_v1.close_agent", "arguments": {"target": "a1"}}),
    "</tool_call>",
)
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files (a patch)."}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        }
    ],
}
TOOLS = [APPLY_PATCH, AGENTS]


@pytest.fixture(scope="module")
def custom_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rcustom", CUSTOM_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def namespace_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rnamespace", NAMESPACE_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rgrammar", TEXT_SCRIPT)) as server:
        yield server


def sdk(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_custom_tool_call_parses_whole_and_streamed(custom_server):
    client = sdk(custom_server)
    response = client.responses.create(model="m", input="Patch hello.txt", tools=TOOLS)
    message, call = response.output
    assert message.type == "message" and response.output_text == "I will patch."
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert call.call_id.startswith("call_") and call.namespace is None

    events = list(client.responses.create(model="m", input="Patch hello.txt", tools=TOOLS, stream=True))
    types = [event.type for event in events]
    assert "response.custom_tool_call_input.delta" in types and "response.custom_tool_call_input.done" in types
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert deltas == done.input == PATCH
    final = events[-1].response
    assert final.output[1].type == "custom_tool_call" and final.output[1].input == PATCH

    # The call and its output go back as items; the continuation's prompt carries both.
    follow = client.responses.create(
        model="m",
        previous_response_id=response.id,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success. A hello.txt"}],
        tools=TOOLS,
    )
    kinds = [item.type for item in client.responses.input_items.list(follow.id, order="asc").data]
    assert kinds == ["message", "message", "custom_tool_call", "custom_tool_call_output"]


def test_a_namespace_tool_call_carries_its_namespace(namespace_server):
    response = sdk(namespace_server).responses.create(model="m", input="Close agent a1", tools=TOOLS)
    [call] = response.output
    assert call.type == "function_call" and (call.namespace, call.name) == ("multi_agent_v1", "close_agent")
    assert json.loads(call.arguments) == {"target": "a1"}


@pytest.mark.parametrize(
    "fmt, pattern",
    [
        (
            {"type": "grammar", "syntax": "lark", "definition": 'start: "ok " NUM\nNUM: /[0-9]{1,3}/\n'},
            r"ok [0-9]{1,3}",
        ),
        ({"type": "grammar", "syntax": "regex", "definition": r"(yes|no) [a-c]{2}"}, r"(yes|no) [a-c]{2}"),
    ],
)
def test_a_grammar_forced_custom_tool_answers_an_input_its_grammar_matches(text_server, fmt, pattern):
    tool = {"type": "custom", "name": "answer", "format": fmt}
    client = sdk(text_server)
    response = client.responses.create(
        model="m", input="Answer.", tools=[tool], tool_choice={"type": "custom", "name": "answer"}, max_output_tokens=32
    )
    [call] = response.output
    assert call.type == "custom_tool_call" and call.name == "answer"
    assert re.fullmatch(pattern, call.input), call.input
    assert response.status == "completed"
    # The scripted model alone would have said its script: the grammar chose every token.
    free = client.responses.create(model="m", input="Answer.", tools=[tool])
    assert free.output_text == "".join(TEXT_SCRIPT)
