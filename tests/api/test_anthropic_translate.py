"""Anthropic Messages → typed chat request, and the stream encoder, without a server."""

from __future__ import annotations

import json

import pytest

from api.anthropic.encode import AnthropicStream, stop_reason, tool_input, usage
from api.anthropic.translate import count_request, messages_request
from api.chat_request import ReasoningOptions
from api.completion import Completion
from api.errors import ApiError
from api.pipeline.events import TextDelta, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart
from api.structured import ForcedToolCall
from model.text import grammar

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}}
IMAGE_MESSAGE = "image_url content parts are not supported: this server has no image input (text-only model)"


def test_system_blocks_roles_and_generation_fields():
    request = messages_request(
        {
            "system": [
                {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "two"},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "c"},
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
    assert request.prompt.messages == (
        {"role": "system", "content": "one\ntwo"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "c"},
    )
    generation, sampling = request.generation, request.generation.sampling
    assert (generation.max_tokens, generation.stream, request.stop) == (9, True, ("END",))
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.5, 0.9, 40, 0.1)
    assert sampling.repetition_penalty == 1.1
    assert generation.seed is None  # no seed key: admission draws a default seed


def test_tool_use_tool_result_and_thinking_blocks():
    request = messages_request(
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
            ],
            "max_tokens": 8,
        }
    )
    assert request.prompt.messages == (
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "hmm",  # earlier thinking reaches the template, which decides
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},  # as templates read it
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},  # before the turn's text
        {"role": "user", "content": "and then?"},
    )


def test_tools_tool_choice_and_thinking_config():
    request = messages_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {"name": "f", "description": "does f", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 1},  # server tool: dropped
            ],
            "tool_choice": {"type": "tool", "name": "f"},
            "thinking": {"type": "disabled"},
            "max_tokens": 8,
        }
    )
    assert request.prompt.tools == (
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "does f"}},
    )
    if grammar.available():  # a named tool is a forced call: a grammar, where an engine runs one
        assert request.constraint is not None
        assert request.constraint.forced == ForcedToolCall(tools=(("f", {"type": "object"}),))
    else:
        assert request.constraint is None
    assert request.prompt.reasoning == ReasoningOptions(enable_thinking=False)
    none = messages_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "none"},
            "max_tokens": 8,
        }
    )
    assert none.prompt.tools is None and none.constraint is None  # "none" drops the tools


def test_tool_choice_any_forces_a_call_of_any_client_tool():
    def translate(choice):
        return messages_request(
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {"name": "f", "input_schema": {"type": "object"}},
                    {"name": "g", "input_schema": {"type": "object"}},
                    {"type": "web_search_20250305", "name": "web_search"},  # server tool: not callable
                ],
                "tool_choice": choice,
                "max_tokens": 8,
            }
        )

    forced = translate({"type": "any", "disable_parallel_tool_use": True})
    assert [t["function"]["name"] for t in forced.prompt.tools] == ["f", "g"]
    if grammar.available():  # enforced as OpenAI's "required": exactly one call, of f or g
        assert forced.constraint.forced == ForcedToolCall(tools=(("f", {"type": "object"}), ("g", {"type": "object"})))
        assert forced.constraint.constraint.kind == "tool_call"
    for choice in ({"type": "auto"}, None):
        assert translate(choice).constraint is None


@pytest.mark.parametrize("translate", [messages_request, count_request])
@pytest.mark.parametrize(
    "extra, message",
    [
        ({"messages": [{"role": "developer", "content": "s"}]}, "messages.0.role: must be 'user', 'assistant' or"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages.1.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages.0.role"),
        ({"tool_choice": {"type": "bogus"}}, "tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got 'bogus'"),
        ({"tool_choice": {"type": ["any"]}}, "tool_choice.type"),
        ({"tool_choice": {}}, "tool_choice.type"),
        ({"tool_choice": "any"}, "tool_choice: must be an object"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name: must be a string"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name: 'nope' is not in tools"),
        ({"tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}}, "disable_parallel_tool_use"),
        ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice 'any' forces a tool call, but no client tool"),
        ({"tools": None, "tool_choice": {"type": "tool", "name": "f"}}, "no client tool"),
        ({"thinking": {"type": 1}}, "thinking.type: must be 'enabled', 'adaptive' or 'disabled'"),
        ({"thinking": {}}, "thinking.type"),
        ({"thinking": "enabled"}, "thinking: must be an object"),
        ({"output_config": "high"}, "output_config: must be an object"),
        ({"output_config": {"effort": 3}}, "output_config.effort: must be"),
        ({"context_management": []}, "context_management: must be an object"),
        ({"context_management": {"edits": {}}}, "context_management.edits: must be an array"),
        ({"context_management": {"edits": [{"keep": "all"}]}}, "context_management.edits.0.type: must be a string"),
        (
            {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}},
            "context_management.edits.0.keep: must be 'all' or",
        ),
        ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "a system message takes text blocks"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0.type: must be a string"),
        ({"tools": [{"name": "f", "input_schema": {}, "defer_loading": "y"}]}, "tools.0.defer_loading"),
        ({"thinking": {"type": "enabled", "budget_tokens": "1024"}}, "thinking.budget_tokens: must be an integer"),
    ],
)
def test_loose_fields_are_400(translate, extra, message):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "max_tokens": 8,
        **extra,
    }
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ApiError) as info:
        translate(body)
    assert info.value.status == 400 and message in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("budget", "max_tokens", "message"),
    [(1000, 4096, "greater than or equal to 1024"), (1024, 1024, "`max_tokens` must be greater than")],
)
def test_an_enabled_thinking_budget_follows_anthropics_rules(budget, max_tokens, message):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": max_tokens,
        "thinking": {"type": "enabled", "budget_tokens": budget},
    }
    with pytest.raises(ApiError) as info:
        messages_request(body)
    assert info.value.status == 400 and message in info.value.message, info.value.message
    count_request(body)  # count_tokens takes no max_tokens: the budget does not apply there


def test_valid_thinking_and_tool_choice_shapes_pass():
    for thinking, enabled in (({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "disabled"}, False)):
        body = {"messages": [{"role": "user", "content": "x"}], "thinking": thinking, "max_tokens": 2048}
        assert messages_request(body).prompt.reasoning == ReasoningOptions(enable_thinking=enabled)
        assert messages_request(body).generation.thinking_budget == (1024 if enabled else None)
        # an explicit chat_template_kwargs switch wins over `thinking`
        body["chat_template_kwargs"] = {"enable_thinking": not enabled}
        assert messages_request(body).prompt.reasoning == ReasoningOptions(enable_thinking=not enabled)
    # auto / none need no tools (nothing is forced)
    for choice in ({"type": "auto"}, {"type": "none"}):
        body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": choice, "max_tokens": 8}
        assert messages_request(body).prompt.tools is None


@pytest.mark.parametrize("translate", [messages_request, count_request])
def test_images_are_a_400_after_the_request_shape_checks(translate):
    url_image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    for image in (IMAGE, url_image):
        with pytest.raises(ApiError) as info:
            translate({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]})
        assert (info.value.status, info.value.message) == (400, IMAGE_MESSAGE)
        assert (info.value.param, info.value.code) == ("messages", "unsupported_content_type")
    with pytest.raises(ApiError, match="an image needs a base64 or url source"):
        translate({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]})
    # The request's own shape is checked first: a later bad block names itself, not the image.
    with pytest.raises(ApiError, match="only plain-text documents are supported"):
        translate(
            {"messages": [{"role": "user", "content": [IMAGE]}, {"role": "user", "content": [{"type": "document"}]}]}
        )


def test_an_image_is_reported_after_the_shape_and_before_the_generation_fields():
    with pytest.raises(ApiError, match="stop_sequences"):
        messages_request({"messages": [{"role": "user", "content": [IMAGE]}], "stop_sequences": "END"})
    with pytest.raises(ApiError) as info:
        messages_request({"messages": [{"role": "user", "content": [IMAGE]}], "temperature": "hot"})
    assert info.value.message == IMAGE_MESSAGE


def test_a_tool_result_id_must_be_a_string_named_as_anthropic_names_it():
    body = {"system": "s", "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}]}
    with pytest.raises(ApiError) as info:
        messages_request(body)
    assert (info.value.message, info.value.param) == ("messages.0.content.0.tool_use_id: must be a string", "messages")


def test_disable_parallel_tool_use_keeps_one_call():
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "tools": tools}
    assert messages_request(body).parallel_tool_calls is True
    for kind in ("auto", "any"):
        serial = {**body, "tool_choice": {"type": kind, "disable_parallel_tool_use": True}}
        assert messages_request(serial).parallel_tool_calls is False
    parallel = {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": False}}
    assert messages_request(parallel).parallel_tool_calls is True


@pytest.mark.parametrize(
    "request_body, message",
    [
        ({"messages": []}, "messages: at least one message is required"),
        ({}, "messages: at least one message is required"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "audio"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "audio"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0.source: only plain-text documents are supported",
        ),
        ({"messages": [{"role": "user", "content": 7}]}, "content"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 8,
                "output_config": {"format": {"type": "x"}},
            },
            "output_config.format.type: must be 'json_schema'",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "output_format": {"type": "json_schema"}},
            "output_format.schema: must be a JSON schema object",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}
                ]
            },
            "messages.0.content.0.input: must be an object",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": None}]}
                ]
            },
            "messages.0.content.0.input: must be an object",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages.0.content.0.tool_use_id: Field required",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "metadata": "u"}, "metadata: must be"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "metadata": {"user_id": 42}},
            "metadata.user_id: must be a string",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "metadata": {"user_id": "u" * 257}},
            "metadata.user_id: must be a string of at most 256",
        ),
    ],
)
def test_bad_requests_are_400(request_body, message):
    with pytest.raises(ApiError) as info:
        messages_request(request_body)
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


def test_tool_input_is_the_object_the_arguments_describe_so_far():
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input('{"city": "Paris", "unit": "cel') == {"city": "Paris"}  # a cut call: no invented key
    assert tool_input("{oops") == {}
    assert tool_input("[1]") == {}


def whole_message(events: list, completion: Completion) -> dict:
    """The whole answer as the route builds it: the stream's encoder without frames."""
    builder = AnthropicStream(message_id="msg_x", model="m", input_tokens=0, frames=False)
    assert builder.add(events) == b""
    return builder.message(completion)


def test_whole_message_content_in_generation_order():
    call = ToolCall("call_1", "f", '{"a": 1}')
    events = [
        TextDelta("reasoning", "think"),
        TextDelta("content", "Sure."),
        ToolCallStart(0, "call_1", "f"),
        ToolCallDelta(0, '{"a": 1}'),
        TextDelta("content", "Done."),
        ToolCallsEvent((call,)),
    ]
    completion = Completion(finish_reason="tool_calls", usage={"prompt_tokens": 4, "completion_tokens": 2})
    message = whole_message(events, completion)
    [use] = [block for block in message["content"] if block["type"] == "tool_use"]
    assert use["id"].startswith("toolu_01") and len(use["id"]) == len("toolu_01") + 22 and use["id"].isascii()
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": use["id"], "name": "f", "input": {"a": 1}},
        {"type": "text", "text": "Done."},
    ]
    assert message["stop_reason"] == "tool_use"
    empty = whole_message([], Completion(finish_reason="stop", usage={}))
    assert empty["content"] == [{"type": "text", "text": ""}]


def test_a_stream_never_builds_tool_use_inputs(monkeypatch):
    """A stream sends the input as its pieces: the object (a parse of the whole arguments) is
    only the whole answer's."""

    def no_input(arguments: str) -> dict:
        raise AssertionError("a stream built a tool_use input")

    monkeypatch.setattr("api.anthropic.encode.tool_input", no_input)
    stream = AnthropicStream(message_id="msg_x", model="m", input_tokens=5)
    arguments = json.dumps({"rows": list(range(10_000))})
    data = stream.start() + stream.add([ToolCallStart(0, "call_1", "f"), ToolCallDelta(0, arguments)])
    data += stream.add([TextDelta("content", "after"), ToolCallsEvent((ToolCall("call_1", "f", arguments),))])
    data += stream.finish(finish_reason="tool_calls", matched_stop=None, openai_usage={})
    deltas = [e["delta"] for e in frames(data) if e["type"] == "content_block_delta"]
    assert deltas[0] == {"type": "input_json_delta", "partial_json": arguments}


def frames(data: bytes) -> list[dict]:
    return [json.loads(f.split("data: ", 1)[1]) for f in data.decode().split("\n\n") if f.strip()]


def test_stream_switches_blocks_and_streams_tools():
    stream = AnthropicStream(message_id="msg_x", model="m", input_tokens=5)
    data = stream.start()
    data += stream.add([TextDelta("reasoning", "a"), TextDelta("reasoning", "b")])
    data += stream.add([TextDelta("content", "c"), ToolCallStart(0, "call_1", "f"), ToolCallDelta(0, '{"a": 1}')])
    data += stream.add([ToolCallsEvent((ToolCall("call_1", "f", '{"a": 1}'),))])  # (every call already streamed)
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


def test_metadata_with_a_string_or_null_user_id_passes():
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    for metadata in (None, {}, {"user_id": None}, {"user_id": "u" * 256}):
        messages_request({**body, "metadata": metadata})


# --- the API as clients send it today (Claude Code's shape) -------------------------------------


def test_mid_conversation_system_adaptive_thinking_effort_and_unknown_fields():
    request = messages_request(
        {
            "model": "m",
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "header"},
                {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "hi"}]},
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}],
                },
                {"role": "system", "content": "later note"},
            ],
            "max_tokens": 32000,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "high", "verbosity": "low"},
            "context_management": {
                "edits": [{"type": "clear_thinking_20251015", "keep": "all"}, {"type": "clear_tool_uses_20250919"}]
            },
            "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
            "service_tier": "auto",
            "stream": True,
        }
    )
    assert request.prompt.messages == (
        {"role": "system", "content": "header\nYou are an agent."},
        {"role": "user", "content": "<reminder>\nhi"},
        {"role": "system", "content": "# Environment"},  # where it was sent
        {"role": "system", "content": "later note"},
    )
    # adaptive thinking turns the template's thinking on; effort "high" is the template's top depth
    assert request.prompt.reasoning == ReasoningOptions(enable_thinking=True, effort="xhigh")
    assert set(request.ignored) == {
        "output_config.verbosity",
        "context_management.edits.type",
        "service_tier",
    }
    assert len(request.cache_points) == 2  # the system block and the mid-conversation system block


@pytest.mark.parametrize(
    "effort, depth", [("low", "low"), ("medium", "medium"), ("high", "xhigh"), ("max", "xhigh"), ("turbo", None)]
)
def test_output_config_effort_is_the_templates_depth(effort, depth):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "output_config": {"effort": effort}}
    request = messages_request(body)
    assert request.prompt.reasoning == ReasoningOptions(effort=depth)  # effort alone never switches thinking
    assert request.ignored == (() if depth else ("output_config.effort",))


def test_an_unknown_thinking_type_or_block_type_is_ignored_not_refused():
    request = messages_request(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "search_result", "x": 1}]},
            ],
            "thinking": {"type": "turbo"},
            "max_tokens": 8,
        }
    )
    assert request.prompt.messages == ({"role": "user", "content": "a"},)
    assert request.prompt.reasoning == ReasoningOptions()  # the template's default
    assert set(request.ignored) == {"thinking.type", "messages.content.type"}


def _thinking_turn(text: str) -> dict:
    return {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": text, "signature": "s"}, {"type": "text", "text": "ok " + text}],
    }


@pytest.mark.parametrize(
    "management, kept",
    [
        (None, ["t1", "t2", "t3"]),  # no edit: every turn's thinking reaches the template
        ({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, ["t1", "t2", "t3"]),
        ({"edits": [{"type": "clear_thinking_20251015"}]}, ["t3"]),  # keep defaults to the last turn
        (
            {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]},
            ["t2", "t3"],
        ),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}, []),
    ],
)
def test_clear_thinking_keeps_the_last_n_thinking_turns(management, kept):
    messages = []
    for text in ("t1", "t2", "t3"):
        messages += [{"role": "user", "content": "q"}, _thinking_turn(text)]
    body = {"messages": [*messages, {"role": "user", "content": "q"}], "max_tokens": 8}
    if management is not None:
        body["context_management"] = management
    assistants = [m for m in messages_request(body).prompt.messages if m["role"] == "assistant"]
    assert [m.get("reasoning_content") for m in assistants if "reasoning_content" in m] == kept
    assert [m["content"] for m in assistants] == ["ok t1", "ok t2", "ok t3"]


def test_deferred_tools_join_once_a_tool_reference_names_them():
    tools = [
        {"name": "Read", "input_schema": {"type": "object"}},
        {"name": "WebFetch", "input_schema": {"type": "object"}, "defer_loading": True},
        {"name": "Cron", "input_schema": {"type": "object"}, "defer_loading": True},
    ]
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "tools": tools}
    assert [t["function"]["name"] for t in messages_request(body).prompt.tools] == ["Read"]
    searched = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                }
            ],
        },
    ]
    request = messages_request({**body, "messages": searched})
    assert [t["function"]["name"] for t in request.prompt.tools] == ["Read", "WebFetch"]


def test_documents_with_a_text_source_are_text():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
                    {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "more"}]}},
                    {"type": "text", "text": "summarize"},
                ],
            }
        ],
        "max_tokens": 8,
    }
    assert messages_request(body).prompt.messages == ({"role": "user", "content": "doc\nmore\nsummarize"},)


def test_output_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for body in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        request = messages_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **body})
        if grammar.available():
            assert request.constraint.constraint.kind == "json_schema"
            assert json.loads(request.constraint.constraint.spec) == schema
