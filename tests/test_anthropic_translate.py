"""Anthropic Messages → chat-body mapping (spec §1.4) and the stream encoder, without a server."""

from __future__ import annotations

import json

import pytest

from api.anthropic_translate import AnthropicStream, anthropic_to_chat, message_object, stop_reason, tool_input, usage
from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallsEvent
from api.protocol_common import Completion


def test_system_blocks_roles_and_generation_fields():
    chat = anthropic_to_chat(
        {
            "system": [
                {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "two"},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "weird", "content": "c"},
            ],
            "max_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stop_sequences": ["END"],
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "metadata": {"user_id": "u"},
            "stream": True,
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "one\ntwo"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "c"},
    ]
    assert {
        k: chat[k]
        for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "min_p", "repetition_penalty", "stream")
    } == {
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "stream": True,
    }
    assert "metadata" not in chat and "seed" not in chat


def test_tool_use_tool_result_and_thinking_blocks():
    chat = anthropic_to_chat(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "and then?"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                    ],
                },
            ]
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},  # before the turn's text
        {"role": "user", "content": "and then?"},
    ]


def test_tools_tool_choice_and_thinking_config():
    chat = anthropic_to_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {"name": "f", "description": "does f", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 1},  # server tool: dropped
            ],
            "tool_choice": {"type": "tool", "name": "f"},
            "thinking": {"type": "disabled"},
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "does f"}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    none = anthropic_to_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "none"},
        }
    )
    assert none["tool_choice"] == "none"


def test_images_become_image_url_parts():
    chat = anthropic_to_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                    ],
                }
            ]
        }
    )
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
    ]


@pytest.mark.parametrize(
    "request_body, message",
    [
        ({"messages": []}, "messages: at least one message is required"),
        ({}, "messages: at least one message is required"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "audio"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "audio"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "unsupported content block type 'document'",
        ),
        ({"messages": [{"role": "user", "content": 7}]}, "content"),
        ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
    ],
)
def test_bad_requests_are_400(request_body, message):
    with pytest.raises(ApiError) as info:
        anthropic_to_chat(request_body)
    assert info.value.status == 400 and message in info.value.message


def test_stop_reason_and_usage_mapping():
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    base = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(base) == {"input_tokens": 10, "output_tokens": 3}
    cached = {**base, "prompt_tokens_details": {"cached_tokens": 8}}
    assert usage(cached) == {"input_tokens": 2, "output_tokens": 3, "cache_read_input_tokens": 8}


def test_unparseable_tool_arguments_are_kept_raw():
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input("{oops") == {"_raw": "{oops"}
    assert tool_input("[1]") == {"_raw": "[1]"}


def test_message_object_content_order():
    call = ToolCall("call_1", "f", '{"a": 1}')
    completion = Completion(
        content="Sure.",
        reasoning="think",
        calls=[call],
        finish_reason="tool_calls",
        usage={"prompt_tokens": 4, "completion_tokens": 2},
    )
    message = message_object(completion, message_id="msg_x", model="m")
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use"
    empty = message_object(Completion(finish_reason="stop", usage={}), message_id="msg_y", model="m")
    assert empty["content"] == [{"type": "text", "text": ""}]


def frames(data: bytes) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in data.decode().split("\n\n") if f.strip()]


def test_stream_switches_blocks_and_emits_tools_whole():
    stream = AnthropicStream(message_id="msg_x", model="m", input_tokens=5)
    data = stream.start()
    data += stream.add([TextDelta("reasoning", "a"), TextDelta("reasoning", "b")])
    data += stream.add([TextDelta("content", "c"), ToolCallsEvent((ToolCall("call_1", "f", '{"a": 1}'),))])
    data += stream.finish(
        finish_reason="tool_calls", matched_stop=None, openai_usage={"prompt_tokens": 5, "completion_tokens": 4}
    )
    events = frames(data)
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert shape == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert json.loads(events[11]["delta"]["partial_json"]) == {"a": 1}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_empty_stream_still_has_one_text_block():
    stream = AnthropicStream(message_id="msg_x", model="m", input_tokens=1)
    events = frames(stream.start() + stream.finish(finish_reason="stop", matched_stop=None, openai_usage={}))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
