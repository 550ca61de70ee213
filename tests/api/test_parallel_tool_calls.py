"""`parallel_tool_calls: false` (chat, Responses) and Anthropic's `disable_parallel_tool_use: true`:
a reply carries at most its first tool call, streamed or whole, and generation ends once that call
is complete. Real actors and a FakeWorker scripted to emit two hermes calls token by token."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker, ScriptDetokenizer

SCRIPT = [
    "<tool_call>",
    '\n{"name": "f", "arguments": ',
    '{"a": 1}',
    "}\n",
    "</tool_call>",
    "\n<tool_call>",
    '\n{"name": "g", "arguments": ',
    "{}",
    "}\n",
    "</tool_call>",
]
FIRST_CALL_TOKENS = 4  # the first call is whole at its closing "}"
SCHEMA = {"type": "object"}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("f", "g")]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": SCHEMA} for n in ("f", "g")]
ANTHROPIC_TOOLS = [{"name": n, "input_schema": SCHEMA} for n in ("f", "g")]


class ScriptTokenizer(FakeTokenizer):
    def detokenizer(self) -> ScriptDetokenizer:
        return ScriptDetokenizer(SCRIPT)


@asynccontextmanager
async def server():
    worker = FakeWorker(
        prefill_cost=0.1,
        join_cost=0.1,
        step_cost=1.0,
        token_fn=lambda prompt, position: position + 1,  # token i+1 is SCRIPT[i]
        eos_at=lambda spec: len(SCRIPT),
    )
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: ScriptTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
    return out


async def post(client, path: str, body: dict[str, Any]) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json() if not body.get("stream") else sse_data(await response.get_data())


@pytest.mark.parametrize("serial", [False, True])
async def test_chat(autojump_clock, serial):
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS, "max_tokens": 50}
    if serial:
        body["parallel_tool_calls"] = False
    async with server() as client:
        whole = await post(client, "/v1/chat/completions", body)
        chunks = await post(client, "/v1/chat/completions", {**body, "stream": True})
    names = ["f"] if serial else ["f", "g"]
    choice = whole["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
    assert choice["finish_reason"] == "tool_calls"
    assert (whole["usage"]["completion_tokens"] == FIRST_CALL_TOKENS) is serial  # generation stopped early
    headers = [
        call["function"]["name"]
        for c in chunks
        if c["choices"]
        for call in c["choices"][0]["delta"].get("tool_calls") or []
        if call.get("id")
    ]
    assert headers == names and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("serial", [False, True])
async def test_responses(autojump_clock, serial):
    body: dict[str, Any] = {"input": "x", "tools": RESPONSES_TOOLS, "max_output_tokens": 50, "store": False}
    if serial:
        body["parallel_tool_calls"] = False
    async with server() as client:
        whole = await post(client, "/v1/responses", body)
        events = await post(client, "/v1/responses", {**body, "stream": True})
    names = ["f"] if serial else ["f", "g"]
    assert [i["name"] for i in whole["output"] if i["type"] == "function_call"] == names
    assert whole["parallel_tool_calls"] is not serial and whole["status"] == "completed"
    added = [
        e["item"]["name"]
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]
    assert added == names and events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("serial", [False, True])
async def test_anthropic(autojump_clock, serial):
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": serial},
        "max_tokens": 50,
    }
    async with server() as client:
        whole = await post(client, "/v1/messages", body)
        events = await post(client, "/v1/messages", {**body, "stream": True})
    names = ["f"] if serial else ["f", "g"]
    assert [b["name"] for b in whole["content"] if b["type"] == "tool_use"] == names
    assert whole["stop_reason"] == "tool_use"
    assert (whole["usage"]["output_tokens"] == FIRST_CALL_TOKENS) is serial
    started = [
        e["content_block"]["name"]
        for e in events
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"
    ]
    assert started == names
