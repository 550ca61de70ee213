"""Responses → typed chat request, continuation input, and the stream encoder."""

from __future__ import annotations

import json

import pytest

from api.chat_request import ChatRequest, ReasoningOptions
from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallsEvent
from api.responses_encode import ResponseMeta, ResponsesStream, reasoning_token_estimate
from api.responses_translate import input_items, output_to_input, responses_request
from api.structured import ForcedToolCall
from model import grammar
from model.params import Constraint


def chat_of(body: dict, instructions: str | None = None) -> ChatRequest:
    return responses_request(body, input_items(body.get("input")), instructions, vocab_size=None)


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
    assert chat.prompt.messages == ({"role": "system", "content": "sys"}, {"role": "user", "content": "hi"})
    generation, sampling = chat.generation, chat.generation.sampling
    assert generation.max_tokens == 7 and sampling.temperature == 0.2 and sampling.top_k == 3
    assert sampling.logit_bias == ((5, 1.0),) and generation.stream is False
    assert chat_of({"input": "x", "max_tokens": 3}).generation.max_tokens == 3


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
    assert chat.prompt.messages == (
        {"role": "system", "content": "instructions\n\ndev rules\n\nlate system"},  # one leading system message
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [  # arguments as templates read them
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "user", "content": "unknown role"},
    )


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
    assert chat.prompt.tools == (
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}, "description": "does f", "strict": True},
        },
    )
    assert chat.prompt.reasoning == ReasoningOptions(enable_thinking=True, effort="low")
    if grammar.available():
        # The named function is a forced call (it wins); text.format is kept for a model whose
        # tool markup has no grammar.
        assert chat.constraint is not None
        assert chat.constraint.forced == ForcedToolCall(tools=(("f", {"type": "object"}),), strict=True)
        assert chat.constraint.fields.response_format == {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        }
        text_only = chat_of({"input": "x", "text": {"format": {"type": "json_object"}}})
        assert text_only.constraint is not None and text_only.constraint.constraint == Constraint("json_object")
    tools = [{"type": "function", "name": "f"}]
    assert chat_of({"input": "x", "tools": tools, "tool_choice": "none"}).prompt.tools is None
    assert chat_of({"input": "x", "text": {"format": {"type": "text"}}}).constraint is None


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


def test_media_and_call_ids_are_a_400_after_the_request_shape_checks():
    image = {
        "role": "user",
        "content": [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "x"}],
    }
    with pytest.raises(ApiError) as info:
        chat_of({"input": [image]})
    assert (
        info.value.message
        == "image_url content parts are not supported: this server has no image input (text-only model)"
    )
    assert (info.value.status, info.value.param, info.value.code) == (400, "messages", "unsupported_content_type")
    with pytest.raises(ApiError, match="input_audio content parts are not supported"):
        chat_of({"input": [{"role": "assistant", "content": [{"type": "input_audio"}]}]})
    with pytest.raises(ApiError, match="stream must be a boolean"):  # the request's own shape first
        chat_of({"input": [image], "stream": "yes"})
    with pytest.raises(ApiError, match="image_url content parts"):  # then media, before the generation fields
        chat_of({"input": [image], "temperature": "hot"})
    with pytest.raises(ApiError) as info:
        chat_of({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "sys")
    assert info.value.message == "messages[1].tool_call_id must be a string"  # its place after the system message


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
