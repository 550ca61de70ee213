"""Responses → typed chat request, continuation input, and the stream encoder."""

from __future__ import annotations

import json

import pydantic
import pytest

from api.chat_request import ChatRequest, ReasoningOptions
from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart
from api.responses.encode import ResponseMeta, ResponsesStream, reasoning_token_estimate
from api.responses.translate import (
    INCLUDE_VALUES,
    METADATA_MESSAGE,
    input_items,
    output_to_input,
    responses_request,
    stored_input,
)
from api.structured import ForcedToolCall
from model.engine.params import Constraint
from model.text import grammar


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
        forced = ForcedToolCall(tools=(("f", {"type": "object"}),), strict=True, strict_tools=frozenset({"f"}))
        assert chat.constraint.forced == forced
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
    assert output_to_input(output) == output[1:]  # as answered, ids included


RAW_ITEMS = [
    {"role": "developer", "content": "dev rules"},
    {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "item_reference", "id": "msg_old"},
    {"role": "assistant", "content": "Checking."},
    {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
    {"type": "function_call_output", "call_id": "call_1", "output": {"temp": 21}},
    {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sunny"}]},
    {"id": "msg_mine", "role": "critic", "content": "unknown role"},
]


def test_stored_input_is_openais_item_shapes_and_means_the_same_prompt():
    sdk = pytest.importorskip("openai")
    stored = stored_input(RAW_ITEMS)
    item = pydantic.TypeAdapter(sdk.types.responses.ResponseItem)
    for entry in stored:
        item.validate_python(entry)  # what client.responses.input_items.list parses
        assert entry["status"] == "completed"
    assert [(e["type"], e.get("role")) for e in stored] == [
        ("message", "developer"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
        ("function_call_output", None),
        ("message", "user"),  # the role the translation took it for
    ]
    assert stored[0]["id"].startswith("msg_") and stored[4]["id"].startswith("fc_") and stored[-1]["id"] == "msg_mine"
    assert stored[1]["content"] == [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert stored[2]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert stored[3]["content"] == [{"type": "refusal", "refusal": "no"}]
    assert stored[4]["arguments"] == '{"city": "Paris"}' and stored[5]["output"] == '{"temp": 21}'
    assert stored_input(stored) == stored  # idempotent: ids are kept
    # a continuation re-feeds the stored items: the same prompt as the items the client sent
    assert chat_of({"input": stored}, "sys").prompt == chat_of({"input": RAW_ITEMS}, "sys").prompt


def test_vision_input_image_is_stored_as_openai_lists_it():
    image = {"type": "input_image", "image_url": "data:image/png;base64,xx"}
    [stored] = stored_input([{"role": "user", "content": [image]}])
    assert stored["content"] == [{**image, "detail": "auto"}]


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
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id: required"),
        ({"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]}, "input[0].call_id: required"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content: input_text parts need a string 'text'",
        ),
        (
            {"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]},
            "refusal parts need a string 'refusal'",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]: item_reference items are not supported"),
    ],
)
def test_bad_input_is_400(body, message):
    with pytest.raises(ApiError) as info:
        chat_of(body)
    assert info.value.status == 400 and message in info.value.message


F_TOOLS = [{"type": "function", "name": "f"}]


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be a positive integer"),
        ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens must be a positive integer"),
        ({"max_output_tokens": "9"}, "max_output_tokens", "max_output_tokens must be a positive integer"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer"),  # the alias, by its name
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format.type must be 'text', 'json_object'"),
        ({"text": {"format": {}}}, "text.format", "got None"),
        ({"text": {"format": "json"}}, "text.format", "text.format must be an object"),
        ({"text": "json"}, "text", "text must be an object"),
        ({"text": {"format": {"type": "json_schema", "schema": "{}"}}}, "text.format", "schema must be"),
        ({"text": {"format": {"type": "json_schema", "strict": "yes"}}}, "text.format", "strict must be a boolean"),
        ({"text": {"format": {"type": "json_schema", "name": "out"}}}, "text.format", "text.format.schema is required"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "text.format.name is required"),
        ({"text": {"format": {"type": "json_schema", "name": "", "schema": {}}}}, "text.format", "name is required"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "reasoning.effort must be one of 'none'"),
        ({"reasoning": "high"}, "reasoning", "reasoning must be an object"),
        ({"store": "no"}, "store", "store must be a boolean"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "parallel_tool_calls must be a boolean"),
        ({"include": "reasoning.encrypted_content"}, "include", "include must be an array of strings"),
        ({"include": ["message.output_text.logprobs", "secrets"]}, "include", "unknown value 'secrets'"),
        ({"metadata": {"k": 1}}, "metadata", METADATA_MESSAGE),
        ({"metadata": {"k": None}}, "metadata", METADATA_MESSAGE),
        ({"metadata": ["k"]}, "metadata", METADATA_MESSAGE),
        ({"metadata": {"k" * 65: "v"}}, "metadata", METADATA_MESSAGE),
        ({"metadata": {"k": "v" * 513}}, "metadata", METADATA_MESSAGE),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", METADATA_MESSAGE),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "'f', which is not in tools"),
        ({"tool_choice": {"type": "function", "name": "g"}, "tools": F_TOOLS}, "tool_choice", "'g', which is not"),
        ({"tool_choice": {"type": "function"}, "tools": F_TOOLS}, "tool_choice", "tool_choice.name must be a string"),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs at least one function tool"),
        ({"tool_choice": "required", "tools": [{"type": "web_search_preview"}]}, "tool_choice", "'required' needs"),
    ],
)
def test_fields_responses_does_not_take_are_a_400_naming_them(fields, param, message):
    with pytest.raises(ApiError) as info:
        chat_of({"input": "x", **fields})
    assert (info.value.status, info.value.param) == (400, param) and message in info.value.message


def test_known_include_values_store_and_parallel_tool_calls_pass():
    everything = list(INCLUDE_VALUES)
    assert chat_of({"input": "x", "include": everything, "store": False}).parallel_tool_calls is True
    assert chat_of({"input": "x", "include": None, "store": None, "parallel_tool_calls": None}).parallel_tool_calls
    assert chat_of({"input": "x", "parallel_tool_calls": False}).parallel_tool_calls is False


def test_logprobs_are_not_captured():
    """Output_text parts carry no logprobs here (always []), so asking captures none: the row
    would compute them for nothing."""
    body = {"input": "x", "logprobs": True, "top_logprobs": 5, "include": ["message.output_text.logprobs"]}
    generation = chat_of(body).generation
    assert (generation.logprobs, generation.top_logprobs) == (False, 0)


def test_a_reference_beside_real_items_is_still_dropped():
    reference = {"type": "item_reference", "id": "msg_1"}
    assert chat_of({"input": [reference, {"role": "user", "content": "hi"}]}).prompt.messages == (
        {"role": "user", "content": "hi"},
    )


def test_the_prompt_is_named_input_in_its_400s():
    assert chat_of({"input": "x"}).prompt.param == "input"  # the chat core's context-length 400 names it


def test_valid_metadata_text_formats_and_tool_choices_pass():
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    chat_of({"input": "x", "metadata": metadata, "text": {"format": {"type": "text"}, "verbosity": "low"}})
    chat_of({"input": "x", "metadata": None, "text": {}, "tools": F_TOOLS, "tool_choice": "required"})
    chat_of({"input": "x", "tools": F_TOOLS, "tool_choice": {"type": "function", "name": "f"}})
    assert chat_of({"input": "x", "max_output_tokens": 5}).generation.max_tokens == 5


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
    assert (info.value.status, info.value.param, info.value.code) == (400, "input", "unsupported_content_type")
    with pytest.raises(ApiError, match="input_audio content parts are not supported"):
        chat_of({"input": [{"role": "assistant", "content": [{"type": "input_audio"}]}]})
    with pytest.raises(ApiError, match="stream must be a boolean"):  # the request's own shape first
        chat_of({"input": [image], "stream": "yes"})
    with pytest.raises(ApiError, match="image_url content parts"):  # then media, before the generation fields
        chat_of({"input": [image], "temperature": "hot"})
    with pytest.raises(ApiError) as info:
        chat_of({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "sys")
    assert (info.value.message, info.value.param) == ("input[0].call_id must be a string", "input")  # Responses' names


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
    data += stream.add([ToolCallStart(0, "call_ab12", "f"), ToolCallDelta(0, '{"a": 1}')])
    data += stream.add([ToolCallsEvent((ToolCall("call_ab12", "f", '{"a": 1}'),))])  # (every call already streamed)
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
