"""Tool calls that parse, through the real server over a random tiny model: under
`tool_choice: "auto"` a `strict` tool's arguments follow its schema once the model opens a call
(a lazy grammar; a logit bias makes this model open one), `"required"` takes several calls when
parallel calls are allowed, and Qwen3-Coder's XML call format is constrained too (a chat template
in that format, `--chat-template`)."""

from __future__ import annotations

import json

import pytest
import trio

from tests.realserver import CHAT, real_server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

LIMIT_S = 180
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CODER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\nCall tools as <tool_call>\n<function=NAME>\n"
    "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tools(strict: bool) -> list[dict]:
    return [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA, "strict": strict}}]


def valid(arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


async def post(server, body):
    response = await server.client.post(CHAT, json=body)
    assert response.status_code == 200, await response.get_data()
    return (await response.get_json())["choices"][0]


async def test_strict_tool_arguments_under_auto_follow_the_schema(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            opening = server.tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
            loose = 0
            for seed in range(4):
                body = {
                    "messages": [{"role": "user", "content": f"Weather in city {seed}?"}],
                    "tool_choice": "auto",
                    "parallel_tool_calls": False,
                    "logit_bias": {str(opening): 100},  # this model would never open a call itself
                    "temperature": 1.0,
                    "seed": seed,
                    "max_tokens": 80,
                }
                strict = await post(server, {**body, "tools": tools(strict=True)})
                assert strict["finish_reason"] == "tool_calls", strict
                assert valid(strict["message"]["tool_calls"][0]["function"]["arguments"])
                free = await post(server, {**body, "tools": tools(strict=False)})
                calls = free["message"].get("tool_calls") or []
                loose += not (calls and valid(calls[0]["function"]["arguments"]))
            assert loose > 0  # without strict the same model writes calls that do not parse


async def test_required_takes_several_calls_unless_parallel_calls_are_off(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body = {
                "messages": [{"role": "user", "content": "Weather for two cities?"}],
                "tools": tools(strict=True),
                "tool_choice": "required",
                "max_tokens": 160,
            }
            counts = set()
            for seed in range(4):
                many = await post(server, {**body, "temperature": 1.0, "seed": seed})
                calls = many["message"]["tool_calls"]
                assert all(valid(call["function"]["arguments"]) for call in calls)
                counts.add(len(calls))
            assert max(counts) > 1  # several calls, each whole and valid
            one = await post(server, {**body, "parallel_tool_calls": False})
            assert len(one["message"]["tool_calls"]) == 1 and one["finish_reason"] == "tool_calls"


async def test_qwen3_coder_calls_are_constrained(model_dir, tmp_path):
    template = tmp_path / "coder.jinja"
    template.write_text(CODER_TEMPLATE)
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=str(template)) as server:
            for seed in range(3):
                body = {
                    "messages": [{"role": "user", "content": f"Weather {seed}?"}],
                    "tools": tools(strict=True),
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                    "temperature": 1.0,
                    "seed": seed,
                    "max_tokens": 120,
                }
                choice = await post(server, body)
                assert choice["finish_reason"] == "tool_calls", choice
                (call,) = choice["message"]["tool_calls"]
                assert call["function"]["name"] == "weather" and valid(call["function"]["arguments"])
