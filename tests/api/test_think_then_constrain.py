"""Think, then constrain, through the real server over a tiny model whose template opens a
reasoning block (tests/helpers/thinking.py): with a grammar (a JSON schema, a forced tool call)
the reasoning is free — the same tokens as without the grammar — and the answer after it follows
the grammar; a request that turns thinking off is constrained from its first token."""

from __future__ import annotations

import json

import pytest
import trio

from tests.helpers.thinking import write_thinking_template
from tests.realserver import CHAT, real_server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

LIMIT_S = 180
BUDGET = 5
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "temp": {"type": "integer"}},
    "required": ["city", "temp"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def body(i: int, **extra):
    messages = [{"role": "user", "content": f"Weather report {i}, please."}]
    return {"messages": messages, "max_tokens": 120, "thinking_token_budget": BUDGET, **extra}


async def post(server, payload):
    response = await server.client.post(CHAT, json=payload)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


async def test_reasoning_is_free_and_the_answer_follows_the_schema(model_dir, tmp_path):
    template = str(write_thinking_template(tmp_path))
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template) as server:
            for i in range(3):
                free = (await post(server, body(i)))["choices"][0]["message"]
                result = await post(server, body(i, response_format=RESPONSE_FORMAT))
                message = result["choices"][0]["message"]
                assert message["reasoning"] == free["reasoning"]  # the grammar waited for the answer
                assert result["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET
                jsonschema.validate(json.loads(message["content"]), SCHEMA)
                assert result["choices"][0]["finish_reason"] == "stop"

            off = await post(
                server, body(0, response_format=RESPONSE_FORMAT, chat_template_kwargs={"enable_thinking": False})
            )
            assert not off["choices"][0]["message"].get("reasoning")
            jsonschema.validate(json.loads(off["choices"][0]["message"]["content"]), SCHEMA)


async def test_a_forced_tool_call_comes_after_free_reasoning(model_dir, tmp_path):
    template = str(write_thinking_template(tmp_path))
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template) as server:
            free = (await post(server, body(7)))["choices"][0]["message"]
            result = await post(server, body(7, tools=TOOLS, tool_choice="required"))
            choice = result["choices"][0]
            assert choice["message"]["reasoning"] == free["reasoning"]
            assert choice["finish_reason"] == "tool_calls"
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
