"""Responses → chat-body mapping (spec §1.5), continuation input, and the stream encoder."""

from __future__ import annotations

import json

import pytest

from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallsEvent
from api.responses_translate import (
    ResponseMeta,
    ResponsesStream,
    input_items,
    output_to_input,
    reasoning_token_estimate,
    responses_to_chat,
)


def chat_of(body: dict, instructions: str | None = None) -> dict:
    return responses_to_chat(body, input_items(body.get("input")), instructions)


def test_string_input_and_generation_fields():
    chat = chat_of(
        {
            "input": "hi",
            "max_output_tokens": 7,
            "temperature": 0.2,
            "top_p": 0.5,
            "top_k": 3,
            "logit_bias": {"5": 1},
            "store": False,
            "truncation": "auto",
        },
        "sys",
    )
    assert chat["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0.2 and chat["top_k"] == 3
    assert chat["logit_bias"] == {"5": 1} and chat["stream"] is False
    assert "store" not in chat and "truncation" not in chat
    assert chat_of({"input": "x", "max_tokens": 3})["max_tokens"] == 3


def test_items_system_merge_function_calls_and_outputs():
    chat = chat_of(
        {
            "input": [
                {"role": "developer", "content": "dev rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "weather "},
                        {"type": "input_text", "text": "in Paris?"},
                    ],
                },
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
                {"role": "system", "content": "late system"},
                {"role": "critic", "content": "unknown role"},
            ]
        },
        "instructions",
    )
    assert chat["messages"] == [
        {"role": "system", "content": "instructions\n\ndev rules\n\nlate system"},  # one leading system message
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "user", "content": "unknown role"},
    ]


def test_tools_flat_to_nested_tool_choice_reasoning_and_text_format():
    chat = chat_of(
        {
            "input": "x",
            "tools": [
                {
                    "type": "function",
                    "name": "f",
                    "description": "does f",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
                {"type": "web_search_preview"},  # built-in: dropped
            ],
            "tool_choice": {"type": "function", "name": "f"},
            "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        }
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "description": "does f", "strict": True},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert chat_of({"input": "x", "tool_choice": "none"})["tool_choice"] == "none"
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


def test_stored_output_becomes_input_without_reasoning():
    output = [
        {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
        },
        {
            "id": "fc_1",
            "type": "function_call",
            "call_id": "call_1",
            "name": "f",
            "arguments": "{}",
            "status": "completed",
        },
    ]
    assert output_to_input(output) == [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": [3]}, "input"),
        ({"input": []}, "at least one input item"),
        ({"input": [{"type": "mystery"}]}, "mystery"),
        ({"input": [{"type": "function_call", "arguments": "{}"}]}, "name"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
        ({"input": "x", "stream": "yes"}, "stream"),
    ],
)
def test_bad_input_is_400(body, message):
    with pytest.raises(ApiError) as info:
        chat_of(body)
    assert info.value.status == 400 and message in info.value.message


def test_reasoning_token_estimate():
    assert reasoning_token_estimate("") == 0
    assert reasoning_token_estimate("   ") == 1
    assert reasoning_token_estimate("three small words") == 3


def events_of(data: bytes) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in data.decode().split("\n\n") if f.strip()]


def test_stream_items_in_order():
    meta = ResponseMeta({"input": "x"}, model="m", instructions=None, previous_response_id=None, store=True)
    stream = ResponsesStream(meta)
    data = stream.start()
    data += stream.add([TextDelta("reasoning", "think"), TextDelta("content", "Hi")])
    data += stream.add([ToolCallsEvent((ToolCall("call_ab12", "f", '{"a": 1}'),))])
    closing, final = stream.finish(
        finish_reason="tool_calls", openai_usage={"prompt_tokens": 3, "completion_tokens": 5}, reasoning="think"
    )
    events = events_of(data + closing)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2] == {
        "id": "fc_ab12",
        "type": "function_call",
        "call_id": "call_ab12",
        "name": "f",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    assert final["status"] == "completed" and final["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}
    assert events[-1]["response"] == final
