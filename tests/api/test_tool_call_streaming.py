"""Tool calls stream on every protocol: the header as soon as the name is known, then the
arguments piece by piece, long before generation ends; the pieces concatenate to exactly the
arguments of the same request answered whole. Real actors and a FakeWorker scripted to emit a
hermes call token by token (MockClock: one virtual second a token)."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import pydantic
import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker, ScriptDetokenizer

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletionChunk  # noqa: E402
from openai.types.responses import ResponseStreamEvent  # noqa: E402

ANTHROPIC_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
RESPONSES_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)

# A forced write_file call with long arguments, one token a piece; the arguments keep the model's
# own spacing (no space after the colons), which a re-encoding would change.
ARGUMENT_PIECES = ['{"path":', '"notes.txt",', ' "content":', ' "', *[f"line {i}\\n" for i in range(30)], '"}']
SCRIPT = [
    "Writing it.",
    "<tool_call>",
    '\n{"name": "write_file", "arguments": ',
    *ARGUMENT_PIECES,
    "}\n",
    "</tool_call>",
]
ARGUMENTS = "".join(ARGUMENT_PIECES)
TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}
STEP = 1.0  # virtual seconds a token


class ScriptTokenizer(FakeTokenizer):
    def detokenizer(self) -> ScriptDetokenizer:
        return ScriptDetokenizer(SCRIPT)


@asynccontextmanager
async def server():
    worker = FakeWorker(
        prefill_cost=0.1,
        join_cost=0.1,
        step_cost=STEP,
        token_fn=lambda prompt, position: position + 1,  # token i+1 is SCRIPT[i]
        eos_at=lambda spec: len(SCRIPT),
    )
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: ScriptTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


async def timed_frames(client, path: str, payload: dict) -> list[tuple[float, str | None, dict | str]]:
    """(arrival time, SSE event name, data) per frame of a streamed response, read as it comes."""
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps({**payload, "stream": True}).encode())
        await conn.send_complete()
        out: list[tuple[float, str | None, dict | str]] = []
        pending = ""
        while True:
            try:
                pending += (await conn.receive()).decode()
            except trio.EndOfChannel:
                return out
            *frames, pending = pending.split("\n\n")
            for frame in frames:
                lines = dict(line.split(": ", 1) for line in frame.split("\n") if ": " in line)
                data = lines["data"]
                out.append((trio.current_time(), lines.get("event"), data if data == "[DONE]" else json.loads(data)))


def assert_streamed_early(times: list[float], end: float) -> None:
    """Many pieces, spread over the generation: the first well before the end, one a token."""
    assert len(times) >= len(ARGUMENT_PIECES) - 1
    assert times[0] <= end - len(ARGUMENT_PIECES) * STEP


async def test_openai_chat_streams_arguments_as_deltas(autojump_clock):
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": TOOL_SCHEMA}}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "write"}], "tools": tools, "max_tokens": 100}
    async with server() as client:
        whole = await (await client.post("/v1/chat/completions", json=body)).get_json()
        frames = await timed_frames(client, "/v1/chat/completions", {**body, "tool_choice": "required"})
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "write_file", "arguments": ARGUMENTS}
    chunks = [(at, data) for at, _, data in frames if isinstance(data, dict) and data["choices"]]
    for _, data in chunks:
        ChatCompletionChunk.model_validate(data)
    deltas = [
        (at, c["choices"][0]["delta"]["tool_calls"][0])
        for at, c in chunks
        if c["choices"][0]["delta"].get("tool_calls")
    ]
    header = deltas[0][1]
    assert header["index"] == 0 and header["type"] == "function" and header["id"].startswith("call_")
    assert header["function"] == {"name": "write_file", "arguments": ""}
    pieces = [(at, d) for at, d in deltas[1:]]
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for _, d in pieces)  # no repeat at the end
    assert "".join(d["function"]["arguments"] for _, d in pieces) == ARGUMENTS
    finish_at, last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert_streamed_early([at for at, _ in pieces], finish_at)


async def test_anthropic_streams_input_json_deltas(autojump_clock):
    tools = [{"name": "write_file", "input_schema": TOOL_SCHEMA}]
    body: dict[str, Any] = {
        "model": "fake-model",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "write"}],
    }
    body["tools"] = tools
    async with server() as client:
        whole = await (await client.post("/v1/messages", json=body)).get_json()
        frames = await timed_frames(client, "/v1/messages", {**body, "tool_choice": {"type": "any"}})
    [use] = [block for block in whole["content"] if block["type"] == "tool_use"]
    for _, name, data in frames:
        if name not in ("ping", "error"):
            ANTHROPIC_EVENT.validate_python(data)
    [start] = [
        (at, d) for at, name, d in frames if name == "content_block_start" and d["content_block"]["type"] == "tool_use"
    ]
    block = start[1]["content_block"]
    assert block["name"] == "write_file" and block["input"] == {} and block["id"].startswith("toolu_01")
    index = start[1]["index"]
    pieces = [
        (at, d["delta"]["partial_json"])
        for at, name, d in frames
        if name == "content_block_delta" and d["index"] == index
    ]
    assert "".join(p for _, p in pieces) == ARGUMENTS
    assert json.loads(ARGUMENTS) == use["input"]
    [(end_at, delta)] = [(at, d) for at, name, d in frames if name == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert [name for _, name, d in frames].count("content_block_stop") == index + 1  # the call's block closes once
    assert_streamed_early([at for at, _ in pieces], end_at)


async def test_responses_streams_function_call_arguments_deltas(autojump_clock):
    tools = [{"type": "function", "name": "write_file", "parameters": TOOL_SCHEMA}]
    body: dict[str, Any] = {
        "model": "fake-model",
        "input": "write",
        "tools": tools,
        "max_output_tokens": 100,
        "store": False,
    }
    async with server() as client:
        whole = await (await client.post("/v1/responses", json=body)).get_json()
        frames = await timed_frames(client, "/v1/responses", {**body, "tool_choice": "required"})
    [item] = [item for item in whole["output"] if item["type"] == "function_call"]
    assert item["arguments"] == ARGUMENTS and item["status"] == "completed"
    for _, _, data in frames:
        RESPONSES_EVENT.validate_python(data)
    events = [(at, d) for at, _, d in frames]
    [added] = [
        d["item"]
        for _, d in events
        if d["type"] == "response.output_item.added" and d["item"]["type"] == "function_call"
    ]
    assert added["name"] == "write_file" and added["arguments"] == "" and added["status"] == "in_progress"
    pieces = [(at, d["delta"]) for at, d in events if d["type"] == "response.function_call_arguments.delta"]
    assert "".join(p for _, p in pieces) == ARGUMENTS
    [done] = [d for _, d in events if d["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == ARGUMENTS
    [(end_at, completed)] = [(at, d) for at, d in events if d["type"] == "response.completed"]
    [final] = [i for i in completed["response"]["output"] if i["type"] == "function_call"]
    assert final["arguments"] == ARGUMENTS and final["call_id"] == added["call_id"] and final["id"] == added["id"]
    assert_streamed_early([at for at, _ in pieces], end_at)


async def test_a_call_cut_by_max_tokens_reads_the_same_whole_and_streamed(autojump_clock):
    # The header and the first pieces went out before the cut and cannot be taken back, so the
    # whole answer reports that same call with the same unfinished arguments, and "length".
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": TOOL_SCHEMA}}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "write"}], "tools": tools, "max_tokens": 10}
    cut = "".join(ARGUMENT_PIECES[:7])  # tokens 4..10 of the script
    async with server() as client:
        whole = await (await client.post("/v1/chat/completions", json=body)).get_json()
        frames = await timed_frames(client, "/v1/chat/completions", body)
        responses_body = {"model": "fake-model", "input": "write", "max_output_tokens": 10, "store": False}
        responses_body["tools"] = [{"type": "function", "name": "write_file", "parameters": TOOL_SCHEMA}]
        response = await (await client.post("/v1/responses", json=responses_body)).get_json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Writing it."
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [cut]
    chunks = [data["choices"][0] for _, _, data in frames if isinstance(data, dict) and data["choices"]]
    streamed = "".join(
        piece["function"].get("arguments", "") for c in chunks for piece in c["delta"].get("tool_calls") or []
    )
    assert streamed == cut and chunks[-1]["finish_reason"] == "length"
    [item] = [item for item in response["output"] if item["type"] == "function_call"]
    assert response["status"] == "incomplete" and item["status"] == "incomplete" and item["arguments"] == cut
