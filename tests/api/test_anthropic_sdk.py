"""The Anthropic Messages surface end to end: the official `anthropic` SDK over real HTTP
(hypercorn on port 0) against the real stack (GPU-worker thread, scheduler, admission, app),
serving tiny scripted checkpoints (model/synth.py) whose greedy output is a fixed token script.

Each model is served once per module from a background thread running its own trio loop (the
`live_server` harness below is shared with tests/test_responses_sdk.py); tests are plain sync
functions driving the SDK.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers.live import TEXT_SCRIPT, THINK_SCRIPT, TOOL_SCRIPT, WEATHER_SCHEMA, Live, live_server, scripted

anthropic = pytest.importorskip("anthropic")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- a real server on a real socket, in a background thread -------------------------------------


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "text", TEXT_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "tool", TOOL_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "think", THINK_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def failing_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "failing", TEXT_SCRIPT), failing=True) as server:
        yield server


def sdk(server: Live) -> Any:
    return anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=60)


TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}]


# --- tests -------------------------------------------------------------------------------------


def test_create_text(text_server):
    client = sdk(text_server)
    message = client.messages.create(model="m", max_tokens=64, system="Be brief.", messages=USER)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "".join(TEXT_SCRIPT)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == len(TEXT_SCRIPT) + 1  # the script, then EOS


def test_max_tokens_and_stop_sequences(text_server):
    client = sdk(text_server)
    short = client.messages.create(model="m", max_tokens=2, messages=USER)
    assert short.content[0].text == "Hello from" and short.stop_reason == "max_tokens"
    stopped = client.messages.create(model="m", max_tokens=64, messages=USER, stop_sequences=[" scripted"])
    assert stopped.content[0].text == "Hello from a"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " scripted"


def test_count_tokens_equals_the_prompt_tokens_in_usage(text_server):
    client = sdk(text_server)
    request = {
        "model": "m",
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [
            {"role": "user", "content": "Count these tokens, please."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": [{"type": "text", "text": "Now."}]},
        ],
        "tools": TOOLS,
    }
    counted = client.messages.count_tokens(**request).input_tokens
    first = client.messages.create(max_tokens=8, **request).usage
    assert counted == first.input_tokens + (first.cache_read_input_tokens or 0)
    assert counted == len(
        text_server.tokenizer.encode_chat(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Count these tokens, please."},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Now."},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "parameters": WEATHER_SCHEMA,
                        "description": "Weather for a city",
                    },
                }
            ],
        )
    )
    # a repeat is served from the prompt cache: input_tokens excludes what was read from it
    again = client.messages.create(max_tokens=8, **request).usage
    assert again.cache_read_input_tokens and again.cache_read_input_tokens > 0
    assert again.input_tokens + again.cache_read_input_tokens == counted


def test_stream_text_stream_and_raw_events_in_order(text_server):
    client = sdk(text_server)
    with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(TEXT_SCRIPT) == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(TEXT_SCRIPT) + 1

    events = list(client.messages.create(model="m", max_tokens=64, messages=USER, stream=True))
    types = [event.type for event in events]
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(TEXT_SCRIPT),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e.delta.text for e in events if e.type == "content_block_delta"] == list(TEXT_SCRIPT)
    assert events[0].message.usage.input_tokens > 0
    assert events[-2].delta.stop_reason == "end_turn"
    # the raw stream also carries the keepalive ping right after message_start (the SDK skips it)
    raw = [name for name, _ in text_server.sse("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER})]
    assert raw[:3] == ["message_start", "ping", "content_block_start"] and raw[-1] == "message_stop"


def test_tool_use(tool_server):
    client = sdk(tool_server)
    message = client.messages.create(model="m", max_tokens=64, messages=USER, tools=TOOLS)
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "I will check."
    call = message.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert message.stop_reason == "tool_use"

    with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=TOOLS) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in events  # the SDK's own event for input_json_delta
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[1].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"

    # the result goes back as a tool_result block: the prompt grows by the round trip
    follow = client.messages.create(
        model="m",
        max_tokens=64,
        tools=TOOLS,
        messages=[
            *USER,
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0) > message.usage.input_tokens
    # without tools in the request the markup is plain text
    plain = client.messages.create(model="m", max_tokens=64, messages=USER)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == "".join(TOOL_SCRIPT)


# A pydantic-style schema (a ref into its own $defs) with a bounded output, so that a model
# scripted to say something else still completes the forced call.
UNIT_TOOL = {
    "name": "set_unit",
    "input_schema": {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "additionalProperties": False,
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
    },
}


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "set_unit"}])
def test_tool_choice_any_or_tool_forces_a_call(text_server, choice):
    pytest.importorskip("llguidance")
    client = sdk(text_server)  # scripted to answer in plain text
    message = client.messages.create(model="m", max_tokens=64, messages=USER, tools=[UNIT_TOOL], tool_choice=choice)
    assert [block.type for block in message.content] == ["tool_use"], message.content
    assert message.content[0].name == "set_unit" and message.content[0].input["unit"] in ("celsius", "fahrenheit")
    assert message.stop_reason == "tool_use"
    free = client.messages.create(model="m", max_tokens=64, messages=USER, tools=[UNIT_TOOL])  # "auto"
    assert [block.type for block in free.content] == ["text"]


def test_thinking(think_server):
    client = sdk(think_server)
    message = client.messages.create(
        model="m", max_tokens=2048, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think." and message.content[0].signature == ""
    assert message.content[1].text == "The answer is 42."
    with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "text" in kinds
    assert final.content[0].thinking == "Let me think." and final.content[1].text == "The answer is 42."
    # prior thinking blocks are dropped on re-ingest (the prompt matches the one without them)
    history = [
        *USER,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": "ok"},
    ]
    without = [*USER, {"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "ok"}]
    assert (
        client.messages.count_tokens(model="m", messages=history).input_tokens
        == client.messages.count_tokens(model="m", messages=without).input_tokens
    )


def test_errors_through_the_sdk(text_server):
    client = sdk(text_server)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=8, messages=[])
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "messages: at least one message is required"},
    }
    with pytest.raises(anthropic.BadRequestError, match="audio"):
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "audio", "source": {"type": "base64", "data": "AA"}}]}],
        )
    # anthropic-version is honoured leniently: absent or unknown is fine
    for headers in ({}, {"anthropic-version": "1999-01-01"}):
        response = httpx.post(
            text_server.base + "/v1/messages", headers=headers, timeout=60, json={"max_tokens": 2, "messages": USER}
        )
        assert response.status_code == 200, response.text


def test_mid_stream_engine_failure_ends_with_the_error_event(failing_server):
    failing_server.worker.fail_in = 2
    events = failing_server.sse("/v1/messages", {"model": "m", "max_tokens": 64, "messages": USER})
    names = [name for name, _ in events]
    at = names.index("error")
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert at == len(names) - 1  # nothing follows the error event (Anthropic's own streams end there)
    assert events[at][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "generation failed: injected engine failure"},
    }
    # the SDK surfaces the error event as an exception
    failing_server.worker.fail_in = 2
    with pytest.raises(anthropic.APIStatusError, match="injected engine failure"):
        with sdk(failing_server).messages.stream(model="m", max_tokens=64, messages=USER) as stream:
            for _ in stream:
                pass
    # and the server keeps serving
    assert sdk(failing_server).messages.create(model="m", max_tokens=64, messages=USER).content[0].text == "".join(
        TEXT_SCRIPT
    )


# --- Claude Code's request shape ---------------------------------------------------------------

CLAUDE_CODE_BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "thinking-token-count-2026-05-13",
    "context-management-2025-06-27",
    "prompt-caching-scope-2026-01-05",
    "mid-conversation-system-2026-04-07",
    "effort-2025-11-24",
]


def claude_code_request(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A request as Claude Code sends it: a system array of three text blocks (two cached), a
    system turn after the first user message, many tools (one deferred), adaptive thinking, an
    effort, a context edit, a JSON user id."""
    tools: list[dict[str, Any]] = [
        {"name": f"Tool{i}", "description": f"Tool number {i}.", "input_schema": WEATHER_SCHEMA} for i in range(22)
    ]
    tools.append({"name": "Read", "description": "Read a file.", "input_schema": WEATHER_SCHEMA})
    tools.append({"name": "Deferred", "description": "Loaded by search.", "input_schema": {}, "defer_loading": True})
    return {
        "model": "m",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be careful with tools.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": tools,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s"})},
    }


CLAUDE_CODE_TURN = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>be nice</system-reminder>"},
            {"type": "text", "text": "Say hello."},
        ],
    },
    {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Primary working directory: /tmp/x"}]},
]


def test_claude_code_request_shape_through_the_sdk(text_server):
    client = sdk(text_server)
    request = claude_code_request(CLAUDE_CODE_TURN)
    with client.beta.messages.stream(**request, betas=CLAUDE_CODE_BETAS) as stream:  # POST /v1/messages?beta=true
        text = "".join(stream.text_stream)
        first = stream.get_final_message()
    assert text == "".join(TEXT_SCRIPT) and first.stop_reason == "end_turn"
    # The system turn is rendered where it was sent (this template can), the deferred tool left out.
    expected = text_server.tokenizer.encode_chat(
        [
            {"role": "system", "content": "You are a coding agent.\nBe careful with tools."},  # no billing header
            {"role": "user", "content": "<system-reminder>be nice</system-reminder>\nSay hello."},
            {"role": "system", "content": "# Environment\n - Primary working directory: /tmp/x"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": t["name"], "parameters": t["input_schema"], "description": t["description"]},
            }
            for t in request["tools"][:-1]
        ],
        enable_thinking=True,
    )
    usage = first.usage  # Anthropic's input_tokens leave out what was written to and read from the cache
    prompt = usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)
    assert prompt == len(expected)
    # The next turn reads the whole first prompt from the cache.
    follow = client.beta.messages.create(
        **claude_code_request(
            [*CLAUDE_CODE_TURN, {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
        ),
        betas=CLAUDE_CODE_BETAS,
    )
    assert follow.content[0].text == "".join(TEXT_SCRIPT)
    assert (follow.usage.cache_read_input_tokens or 0) >= len(expected) - 1
    # Nothing in this shape was unknown; a field the server does not know is counted, not refused.
    extra = client.beta.messages.create(
        **claude_code_request(CLAUDE_CODE_TURN), betas=CLAUDE_CODE_BETAS, extra_body={"speed": "fast"}
    )
    assert extra.content[0].text == "".join(TEXT_SCRIPT)
    metrics = httpx.get(text_server.base + "/metrics").text
    assert 'mlx_trio:ignored_fields_total{field="speed"} 1.0' in metrics
