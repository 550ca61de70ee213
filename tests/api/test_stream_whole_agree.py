"""A greedy request answers the same whole and streamed, on every protocol: the stream, as the
official SDKs accumulate it (`messages.stream(...).get_final_message()`,
`responses.stream(...).get_final_response()`, `chat.completions.stream(...)
.get_final_completion()`), equals the non-stream answer. Content comes in generation order (text,
calls, more text), and a call cut by max_tokens or by broken markup has one value both ways
(Anthropic: the object its streamed input_json pieces describe so far, never an invented key).

Real actors and a FakeWorker scripted token by token; the SDKs read the server's exact bytes
through an httpx MockTransport.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.partial_json import MAX_DEPTH
from tests.fakes import FakeTokenizer, FakeWorker, ScriptDetokenizer

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}


def call(city: str) -> list[str]:
    return [
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": ',
        '{"city": ',
        f'"{city}"',
        "}",
        "}\n",
        "</tool_call>",
    ]


# Text, three calls, more text: each protocol's content keeps this order.
TEXT_AROUND_CALLS = ["Checking", " three cities.", *call("Paris"), *call("London"), *call("Tokyo"), "\nAll", " asked."]
# One call whose arguments a max_tokens below its length cuts; token k is CUT_CALL[k - 1].
CUT_CALL = [
    "Let me look.",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": ',
    '{"city": ',
    '"Pa',
    'ris", ',
    '"unit": ',
    '"cel',
    'sius"}',
    "}\n",
    "</tool_call>",
]
# Markup that breaks after the call's header: the call ends there, the rest of the block is dropped.
BROKEN_CALL = [
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": ',
    '{"city": "Paris", ',
    "oops}",
    "}\n",
    "</tool_call>",
]


@asynccontextmanager
async def server(script: list[str]):
    class Tokenizer(FakeTokenizer):
        def detokenizer(self) -> ScriptDetokenizer:
            return ScriptDetokenizer(script)

    worker = FakeWorker(
        prefill_cost=0.1,
        join_cost=0.1,
        step_cost=1.0,
        token_fn=lambda prompt, position: position + 1,  # token i+1 is script[i]
        eos_at=lambda spec: len(script),
    )
    async with trio.open_nursery() as nursery:
        handles = await start_actors(nursery, worker, options=serve_options(), make_tokenizer=lambda info: Tokenizer())
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


def replay(sdk: Any, status: int, body: bytes, *, stream: bool) -> Any:
    """A client for `sdk` that answers any request with these bytes (what the server sent)."""
    # The SDK's own HTTP package: current SDKs take httpx2 clients, older ones httpx.
    http = getattr(sdk._base_client, "httpx2", None) or httpx
    headers = {"content-type": "text/event-stream" if stream else "application/json"}
    return http.Client(
        transport=http.MockTransport(lambda request: http.Response(status, content=body, headers=headers))
    )


async def both(sdk: Any, client: Any, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The same request whole and streamed, each as a client replaying the server's bytes."""
    whole = await client.post(path, json={**body, "stream": False})
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        streamed = b""
        while True:
            try:
                streamed += await conn.receive()
            except trio.EndOfChannel:
                break
    return replay(sdk, whole.status_code, await whole.get_data(), stream=False), replay(sdk, 200, streamed, stream=True)


def renumber(value: Any, prefixes: tuple[str, ...]) -> Any:
    """`value` with every id-like string (one of `prefixes`) replaced by its order of appearance,
    so two answers differing only in their random ids compare equal."""
    seen: dict[str, str] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str) and v.startswith(prefixes):
            return seen.setdefault(v, f"<id{len(seen)}>")
        return v

    return walk(value)


# --- Anthropic ----------------------------------------------------------------------------------


async def anthropic_pair(script: list[str], max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {
        "model": "fake-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
    }
    async with server(script) as client:
        whole_http, stream_http = await both(anthropic, client, "/v1/messages", body)
    kwargs: dict[str, Any] = {k: v for k, v in body.items()}
    whole = anthropic.Anthropic(api_key="x", base_url="http://test", http_client=whole_http).messages.create(**kwargs)
    sdk = anthropic.Anthropic(api_key="x", base_url="http://test", http_client=stream_http)
    with sdk.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    prefixes = ("msg_", "toolu_")
    return renumber(whole.model_dump(), prefixes), renumber(streamed.model_dump(), prefixes)


async def test_anthropic_text_after_calls_in_generation_order_both_ways(autojump_clock):
    whole, streamed = await anthropic_pair(TEXT_AROUND_CALLS, 200)
    assert whole == streamed
    blocks = whole["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use", "tool_use", "text"]
    assert [b["text"] for b in blocks if b["type"] == "text"] == ["Checking three cities.", "\nAll asked."]
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [
        {"city": "Paris"},
        {"city": "London"},
        {"city": "Tokyo"},
    ]
    assert whole["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("max_tokens", "expected", "stop_reason"),
    [
        (4, {}, "max_tokens"),  # `{"city": `: a key waiting for its value
        (5, {}, "max_tokens"),  # `"Pa`: a string cut short goes, with its key
        (6, {"city": "Paris"}, "max_tokens"),
        (8, {"city": "Paris"}, "max_tokens"),  # `"unit": "cel`
        (9, {"city": "Paris", "unit": "celsius"}, "tool_use"),  # the arguments are whole, only markup is missing
    ],
)
async def test_anthropic_cut_call_input_is_what_the_stream_rebuilds(autojump_clock, max_tokens, expected, stop_reason):
    whole, streamed = await anthropic_pair(CUT_CALL, max_tokens)
    assert whole == streamed
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == expected  # no invented `_raw` key: the tool's schema has none
    assert whole["stop_reason"] == stop_reason


async def test_anthropic_call_broken_after_its_header_reads_the_same_both_ways(autojump_clock):
    whole, streamed = await anthropic_pair(BROKEN_CALL, 100)
    assert whole == streamed
    assert [(b["type"], b.get("input")) for b in whole["content"]] == [("tool_use", {"city": "Paris"})]


def call_script(arguments: str) -> list[str]:
    return ["<tool_call>", '\n{"name": "get_weather", "arguments": ', arguments, "}\n", "</tool_call>"]


async def test_anthropic_deeply_nested_cut_call_is_still_an_answer(autojump_clock):
    """A call cut 2,000 arrays deep: its input is rebuilt only to a depth JSON encoding takes
    (never a RecursionError, a 500), whole or streamed."""
    body = {
        "model": "fake-model",
        "max_tokens": 3,  # the cut: inside the arguments
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
    }
    async with server(call_script('{"city": "Paris", "deep": ' + "[" * 2_000)) as client:
        response = await client.post("/v1/messages", json=body)
        assert response.status_code == 200
        message = await response.get_json()
        streamed = await client.post("/v1/messages", json={**body, "stream": True})
        assert streamed.status_code == 200 and b"event: message_stop" in await streamed.get_data()
    [use] = message["content"]
    assert use["input"]["city"] == "Paris" and message["stop_reason"] == "max_tokens"
    depth, inner = 1, use["input"]["deep"]
    while inner:
        depth, inner = depth + 1, inner[0]
    assert depth == MAX_DEPTH - 1  # counting the object: the array at MAX_DEPTH is the (empty) last


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "Pa\\ud800ris"}', {"city": "Pa\ufffdris"}),  # a lone surrogate cannot be UTF-8
        ('{"city": "Paris", "n": 1e400}', {}),  # would encode as Infinity, which is not JSON
    ],
)
async def test_anthropic_whole_answer_input_is_always_encodable(autojump_clock, arguments, expected):
    body = {
        "model": "fake-model",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
    }
    async with server(call_script(arguments)) as client:
        response = await client.post("/v1/messages", json=body)
        assert response.status_code == 200
        [use] = (await response.get_json())["content"]
    assert use["input"] == expected


async def test_anthropic_big_whole_call_input_is_its_json(autojump_clock):
    arguments = json.dumps({"city": "Paris", "rows": [{"id": i, "note": f"n{i}", "x": i / 3} for i in range(3_000)]})
    body = {
        "model": "fake-model",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
    }
    async with server(call_script(arguments)) as client:
        message = await (await client.post("/v1/messages", json=body)).get_json()
    [use] = message["content"]
    assert use["input"] == json.loads(arguments) and message["stop_reason"] == "tool_use"


async def test_anthropic_tool_use_ids_are_anthropic_shaped(autojump_clock):
    body = {
        "model": "fake-model",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
    }
    async with server(TEXT_AROUND_CALLS) as client:
        whole = await (await client.post("/v1/messages", json=body)).get_json()
    ids = [b["id"] for b in whole["content"] if b["type"] == "tool_use"]
    assert len(set(ids)) == 3
    for tool_use_id in ids:
        assert tool_use_id.startswith("toolu_01") and len(tool_use_id) == 30
        assert tool_use_id.removeprefix("toolu_").isalnum() and tool_use_id.isascii()


# --- OpenAI Responses ---------------------------------------------------------------------------


async def responses_pair(script: list[str], max_output_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {
        "model": "fake-model",
        "input": "weather?",
        "max_output_tokens": max_output_tokens,
        "store": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
    }
    async with server(script) as client:
        whole_http, stream_http = await both(openai, client, "/v1/responses", body)
    whole = openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=whole_http).responses.create(**body)
    sdk = openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=stream_http)
    with sdk.responses.stream(**body) as stream:
        events = list(stream)
    # The SDK's final response needs response.completed; an incomplete one is its event's object.
    [final] = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    items = [e.item.model_dump() for e in events if e.type == "response.output_item.done"]
    assert drop_parsed(final.model_dump()["output"]) == drop_parsed(items)  # the final object lists what streamed
    prefixes = ("resp_", "msg_", "fc_", "call_")
    dumped = [renumber(drop_parsed({**r.model_dump(), "created_at": 0}), prefixes) for r in (whole, final)]
    return dumped[0], dumped[1]


def drop_parsed(value: Any) -> Any:
    """Without the SDK stream helper's parse results (None here: no text.format, no strict tools)."""
    if isinstance(value, dict):
        return {k: drop_parsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [drop_parsed(v) for v in value]
    return value


async def test_responses_text_after_calls_in_generation_order_both_ways(autojump_clock):
    whole, streamed = await responses_pair(TEXT_AROUND_CALLS, 200)
    assert whole == streamed
    items = whole["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call", "function_call", "message"]
    assert [i["content"][0]["text"] for i in items if i["type"] == "message"] == [
        "Checking three cities.",
        "\nAll asked.",
    ]
    assert [json.loads(i["arguments"]) for i in items if i["type"] == "function_call"] == [
        {"city": "Paris"},
        {"city": "London"},
        {"city": "Tokyo"},
    ]
    assert whole["status"] == "completed" and {i["status"] for i in items} == {"completed"}


@pytest.mark.parametrize("max_output_tokens", [4, 5, 8])
async def test_responses_cut_call_reads_the_same_both_ways(autojump_clock, max_output_tokens):
    whole, streamed = await responses_pair(CUT_CALL, max_output_tokens)
    assert whole == streamed
    assert whole["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in whole["output"]] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]


async def test_responses_ids_follow_openai_conventions(autojump_clock):
    body = {"model": "fake-model", "input": "weather?", "store": False}
    body["tools"] = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    async with server(TEXT_AROUND_CALLS) as client:
        whole = await (await client.post("/v1/responses", json=body)).get_json()
    calls = [i for i in whole["output"] if i["type"] == "function_call"]
    assert all(i["id"].startswith("fc_") and i["call_id"].startswith("call_") for i in calls)
    assert len({i["call_id"] for i in calls}) == 3


# --- OpenAI chat --------------------------------------------------------------------------------


async def chat_pair(script: list[str], max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {
        "model": "fake-model",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
    }
    async with server(script) as client:
        whole_http, stream_http = await both(openai, client, "/v1/chat/completions", body)
    [choice] = (
        openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=whole_http)
        .chat.completions.create(**body)
        .choices
    )
    whole = {
        "content": choice.message.content,
        "calls": [[c.id, c.function.name, c.function.arguments] for c in choice.message.tool_calls or []],
        "finish": choice.finish_reason,
    }
    # The stream accumulated as clients do (the SDK's stream helper refuses a length finish).
    sdk = openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=stream_http)
    content, calls, finish = "", {}, None
    for chunk in sdk.chat.completions.create(**body, stream=True):
        [delta_choice] = chunk.choices
        content += delta_choice.delta.content or ""
        for piece in delta_choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", "", ""])
            call[0] += piece.id or ""
            call[1] += (piece.function and piece.function.name) or ""
            call[2] += (piece.function and piece.function.arguments) or ""
        finish = delta_choice.finish_reason or finish
    streamed = {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish": finish}
    return renumber(whole, ("call_",)), renumber(streamed, ("call_",))


async def test_chat_text_after_calls_reads_the_same_both_ways(autojump_clock):
    whole, streamed = await chat_pair(TEXT_AROUND_CALLS, 200)
    assert whole == streamed
    assert whole["content"] == "Checking three cities.\nAll asked." and len(whole["calls"]) == 3


@pytest.mark.parametrize("max_tokens", [4, 5, 8])
async def test_chat_cut_call_reads_the_same_both_ways(autojump_clock, max_tokens):
    whole, streamed = await chat_pair(CUT_CALL, max_tokens)
    assert whole == streamed
    assert whole["finish"] == "length" and len(whole["calls"]) == 1
