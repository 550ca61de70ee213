"""Tool-call routing: prose streams live, markup is withheld and parsed, bad markup is content."""

from __future__ import annotations

import json
import re
import types

import pytest
from mlx_lm.tokenizer_utils import _infer_tool_parser
from mlx_lm.tool_parsers import json_tools as mlx_json_tools
from mlx_lm.tool_parsers import mistral as mlx_mistral
from test_pipeline_sink import calls_of, stream, texts

from api.pipeline.tools import make_tool_router
from api.pipeline.tools.detect import detect_tool_format
from api.pipeline.tools.hermes import parse_hermes_body
from api.pipeline.tools.mistral import parse_mistral_body

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def run(pieces, tool_format, reason="eos", **options):
    sink, per_push = stream(pieces, tool_format=tool_format, tools_present=True, **options)
    final = sink.finish(reason=reason)
    return sink, per_push, final


# --- hermes -----------------------------------------------------------------------------------


def test_hermes_call_is_parsed_and_prose_before_it_streams_live():
    pieces = ["Let me ", "check. ", "<tool", "_call>\n", WEATHER, "\n</tool", "_call>"]
    sink, per_push, final = run(pieces, "hermes")
    assert [texts(events) for events in per_push[:2]] == ["Let me ", "check. "]
    assert all(texts(events) == "" for events in per_push[2:])
    assert calls_of(sink) == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"call_[0-9a-f]{8}", sink.tool_calls[0].id)
    assert sink.content == "Let me check. "
    assert sink.finish_reason == "tool_calls"


def test_hermes_back_to_back_calls_leave_no_content():
    second = '{"name": "get_time", "arguments": {"tz": "CET"}}'
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>\n"
    sink, _, _ = run(list(text), "hermes")
    assert calls_of(sink) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert sink.content == ""
    assert len({call.id for call in sink.tool_calls}) == 2


def test_prose_after_a_call_is_content_with_its_leading_whitespace():
    sink, _, _ = run([f"<tool_call>{WEATHER}</tool_call>", "\n\nDone."], "hermes")
    assert sink.content == "\n\nDone."
    assert len(sink.tool_calls) == 1


def test_malformed_hermes_markup_is_returned_as_content():
    text = "<tool_call>{not json}</tool_call> after"
    sink, _, _ = run([text], "hermes")
    assert sink.content == text
    assert sink.tool_calls == [] and sink.finish_reason == "stop"


def test_truncated_call_at_length_is_returned_as_content():
    text = '<tool_call>{"name": "f", "argu'
    sink, _, final = run([text], "hermes", reason="length")
    assert texts(final) == text
    assert sink.tool_calls == [] and sink.finish_reason == "length"


def test_unclosed_but_complete_call_at_eos_is_still_a_call():
    sink, _, _ = run([f"<tool_call>{WEATHER}"], "hermes")
    assert calls_of(sink) == [("get_weather", {"city": "Paris"})]


def test_a_partial_marker_at_the_end_is_released():
    sink, per_push, _ = run(["hi <tool_c"], "hermes")
    assert texts(per_push[0]) == "hi "
    assert sink.content == "hi <tool_c"


def test_without_tools_in_the_request_markup_is_content():
    text = f"<tool_call>{WEATHER}</tool_call>"
    sink, _ = stream([text], tool_format="hermes", tools_present=False)
    sink.finish(reason="eos")
    assert sink.content == text and sink.tool_calls == []


def test_arguments_keep_non_ascii_and_string_arguments_are_decoded():
    body = '{"name": "f", "arguments": "{\\"city\\": \\"東京\\"}"}'
    sink, _, _ = run([f"<tool_call>{body}</tool_call>"], "hermes")
    assert sink.tool_calls[0].arguments == '{"city": "東京"}'


def test_tool_call_inside_reasoning_is_extracted():
    # mlx-lm's TextStateMachine lets a call start from the reasoning state; so do we.
    text = f"<think>I need the weather<tool_call>{WEATHER}</tool_call></think>ok"
    sink, _, _ = run([text], "hermes", think=True)
    assert calls_of(sink) == [("get_weather", {"city": "Paris"})]
    assert (sink.reasoning, sink.content) == ("I need the weather", "ok")


@pytest.mark.parametrize(
    "body",
    [WEATHER, '{"name": "f", "arguments": {"a": [1, {"b": null}], "c": "é"}}'],
)
def test_hermes_parse_matches_mlx_lm(body):
    expected = mlx_json_tools.parse_tool_call(body)
    [call] = parse_hermes_body(body)
    assert (call.name, json.loads(call.arguments)) == (expected["name"], expected["arguments"])


# --- qwen3_coder ------------------------------------------------------------------------------

CODER_CALL = (
    "<tool_call>\n<function=search>\n"
    "<parameter=query>\nred shoes\n</parameter>\n"
    "<parameter=limit>\n3\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=exact>\ntrue\n</parameter>\n"
    '<parameter=filters>\n{"size": [41, 42]}\n</parameter>\n'
    "<parameter=code>\n007\n</parameter>\n"
    "<parameter=missing>\nnull\n</parameter>\n"
    "<parameter=weird>\nNaN\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_qwen3_coder_values_are_coerced_to_json_types_where_they_parse():
    sink, _, _ = run(["Searching.\n", *re.split(r"(?<=>)", CODER_CALL)], "qwen3_coder")
    assert calls_of(sink) == [
        (
            "search",
            {
                "query": "red shoes",
                "limit": 3,
                "ratio": 0.5,
                "exact": True,
                "filters": {"size": [41, 42]},
                "code": "007",
                "missing": None,
                "weird": "NaN",
            },
        )
    ]
    assert sink.content == "Searching.\n"


def test_qwen3_coder_multiline_string_keeps_inner_newlines():
    text = "<tool_call>\n<function=write>\n<parameter=body>\nline1\nline2\n</parameter>\n</function>\n</tool_call>"
    sink, _, _ = run([text], "qwen3_coder")
    assert calls_of(sink) == [("write", {"body": "line1\nline2"})]


def test_qwen3_coder_without_a_function_is_content():
    text = "<tool_call>\n{oops}\n</tool_call>"
    sink, _, _ = run([text], "qwen3_coder")
    assert sink.content == text and sink.tool_calls == []


# --- llama3_json ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces",
    [
        ['{"name": "get_weather", ', '"parameters": {"city": "Paris"}}'],
        ["\n", "<|py", "thon_tag|>", WEATHER],
        [f"[{WEATHER}]"],
    ],
)
def test_llama3_json_call_forms(pieces):
    sink, per_push, _ = run(pieces, "llama3_json")
    assert calls_of(sink) == [("get_weather", {"city": "Paris"})]
    assert all(texts(events) == "" for events in per_push)
    assert sink.content == ""


def test_llama3_json_several_calls():
    sink, _, _ = run([f"{WEATHER}; {WEATHER}"], "llama3_json")
    assert [name for name, _ in calls_of(sink)] == ["get_weather", "get_weather"]


def test_llama3_prose_streams_live_even_if_it_mentions_json_later():
    sink, per_push, _ = run(["Sure", ", here: ", WEATHER], "llama3_json")
    assert [texts(events) for events in per_push] == ["Sure", ", here: ", WEATHER]
    assert sink.tool_calls == []


def test_llama3_json_that_is_not_a_call_is_content():
    sink, _, final = run(['{"answer": ', "42}"], "llama3_json")
    assert texts(final) == '{"answer": 42}'
    assert sink.tool_calls == []


# --- mistral ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        'get_weather[ARGS]{"city": "Paris"}',
    ],
)
def test_mistral_call_forms_match_mlx_lm(body):
    sink, per_push, _ = run(["Okay. ", "[TOOL", "_CALLS]", body], "mistral")
    assert texts(per_push[0]) == "Okay. "
    assert calls_of(sink) == [("get_weather", {"city": "Paris"})]
    expected = mlx_mistral.parse_tool_call(body)
    assert calls_of(sink) == [(expected["name"], expected["arguments"])]
    assert sink.content == "Okay. "


def test_mistral_several_calls_with_and_without_repeated_marker():
    joined = 'a[ARGS]{"x": 1} b[ARGS]{"y": 2}'
    repeated = 'a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{"y": 2}'
    for body in (joined, repeated):
        assert [(c.name, json.loads(c.arguments)) for c in parse_mistral_body(body)] == [
            ("a", {"x": 1}),
            ("b", {"y": 2}),
        ]


def test_malformed_mistral_markup_is_content():
    text = "[TOOL_CALLS]get_weather[ARGS]{broken"
    sink, _, _ = run([text], "mistral")
    assert sink.content == text and sink.tool_calls == []


# --- format choice ----------------------------------------------------------------------------

TEMPLATES = {
    "hermes": '{%- for tool_call in message.tool_calls %}<tool_call>\\n{"name": "{{ tool_call.name }}"}',
    "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}",
    "mistral": "{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}",
}


@pytest.mark.parametrize("expected", sorted(TEMPLATES))
def test_detection_from_template_agrees_with_mlx_lm(expected):
    template = TEMPLATES[expected]
    fake_tokenizer = types.SimpleNamespace(chat_template=template, get_vocab=lambda: {})
    mlx_name = {"json_tools": "hermes"}.get(_infer_tool_parser(fake_tokenizer))
    assert detect_tool_format(template, None) == expected
    assert (mlx_name or _infer_tool_parser(fake_tokenizer)) == expected


def test_detection_of_llama3_and_family_fallbacks():
    llama31 = (
        '{{- "<|python_tag|>" + tool_call.name }} '
        '{"name": function name, "parameters": dictionary of argument name and its value}'
    )
    assert detect_tool_format(llama31, "llama") == "llama3_json"
    assert detect_tool_format(None, "qwen3") == "hermes"
    assert detect_tool_format(None, "qwen3_5_moe") == "qwen3_coder"
    assert detect_tool_format(None, "qwen3_next") == "hermes"
    assert detect_tool_format("{{ messages }}", "mistral") == "mistral"
    assert detect_tool_format(None, "gpt2") is None


def test_detection_of_a_plain_llama3_template_without_meta_wording():
    # e.g. model/synth_tokenizer.py's llama3 template: header tokens plus {"name", "parameters"}.
    template = '<|start_header_id|>assistant<|end_header_id|>{{ \'{"name": "\' + call.name + \'", "parameters": \' }}'
    assert detect_tool_format(template, None) == "llama3_json"
    assert detect_tool_format("<|start_header_id|>{{ messages }}", None) is None  # no call format taught


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError):
        make_tool_router("nope", tools_present=True)
