"""Tool-call routing: prose streams live, calls stream as they are parsed (a header once the name
is known, then argument pieces), markup that fails before a header is content."""

from __future__ import annotations

import json
import re
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import _infer_tool_parser
from mlx_lm.tool_parsers import json_tools as mlx_json_tools
from mlx_lm.tool_parsers import mistral as mlx_mistral
from test_pipeline_sink import calls_of, stream, streamed_calls, texts

from api.pipeline.events import ToolCallDelta, ToolCallStart
from api.pipeline.tools import make_tool_router
from api.pipeline.tools.detect import detect_tool_format

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


@pytest.mark.parametrize(
    ("arguments", "is_call"),
    [
        ('{"city": "Paris", "deep": ' + "[" * 1_500 + "]" * 1_500 + "}", True),  # deeper than json.loads goes
        ('{"a": NaN}', False),  # not JSON: it would not re-encode as JSON
        ('{"a": -Infinity}', False),
        ("[1]", False),
        ('{"a": 1} x', False),
        (" ", True),  # blank: "{}"
    ],
)
def test_string_arguments_must_hold_one_json_object(arguments, is_call):
    body = json.dumps({"name": "f", "arguments": arguments})
    sink, _, _ = run([f"<tool_call>{body}</tool_call>"], "hermes")
    assert [call.arguments for call in sink.tool_calls] == ([arguments.strip() or "{}"] if is_call else [])


def test_string_arguments_are_checked_in_one_parse_not_a_character_scan(monkeypatch):
    """A decoded arguments string is whole at once: json.loads checks it (C), never the
    per-character scanner (~0.5 s a megabyte on the event loop)."""
    from api.pipeline.tools import json_calls

    arguments = json.dumps({"rows": [{"id": i, "v": [i, i / 2, None, True]} for i in range(2_000)]})
    fed: list[str] = []

    class Recording(json_calls.JsonScanner):
        def feed(self, text: str, position: int = 0) -> int:
            fed.append(text[position:])
            return super().feed(text, position)

    monkeypatch.setattr(json_calls, "JsonScanner", Recording)
    body = json.dumps({"name": "f", "arguments": arguments})
    sink, _, _ = run([f"<tool_call>{body}</tool_call>"], "hermes")
    assert [call.arguments for call in sink.tool_calls] == [arguments]
    assert arguments not in fed


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
    sink, _, _ = run([f"<tool_call>\n{body}\n</tool_call>"], "hermes")
    assert calls_of(sink) == [(expected["name"], expected["arguments"])]


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
    sink, per_push, _ = run(['{"answer": ', "42}", " and more"], "llama3_json")
    # released as soon as the object closes without a name, the rest then streams as prose
    assert [texts(events) for events in per_push] == ["", '{"answer": 42}', " and more"]
    assert sink.tool_calls == [] and sink.finish_reason == "stop"


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
        sink, _, _ = run(["[TOOL_CALLS]" + body], "mistral")
        assert calls_of(sink) == [("a", {"x": 1}), ("b", {"y": 2})]


def test_malformed_mistral_markup_is_content():
    text = "[TOOL_CALLS]get weather[ARGS]{}"  # no header went out: the name is broken
    sink, _, _ = run([text], "mistral")
    assert sink.content == text and sink.tool_calls == []


def test_mistral_arguments_that_break_after_the_header_are_cut_there():
    sink, _, _ = run(["[TOOL_CALLS]get_weather[ARGS]{", "broken"], "mistral")
    assert [(c.name, c.arguments) for c in sink.tool_calls] == [("get_weather", "{")]
    assert sink.content == "" and sink.finish_reason == "tool_calls"


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


# --- calls stream: a header once the name is known, then the arguments piece by piece ---------


def run_chars(text, tool_format, reason="eos"):
    """Token by token, one character a token: (sink, events of each push, final events)."""
    return run(list(text), tool_format, reason=reason)


def header_and_argument_pushes(per_push):
    """The push that carried the first header, and those that carried argument pieces."""
    header = next(i for i, events in enumerate(per_push) if any(isinstance(e, ToolCallStart) for e in events))
    pieces = [i for i, events in enumerate(per_push) if any(isinstance(e, ToolCallDelta) for e in events)]
    return header, pieces


def raw_calls(sink):
    return [(call.name, call.arguments) for call in sink.tool_calls]


LONG_ARGUMENTS = '{"path":"a.py",  "content": "line 1\\nline \\"2\\"\\u00e9 東京", "n": [1, -2.5e3, true, null]}'


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        ("hermes", f'Hi.<tool_call>\n{{"name": "write", "arguments": {LONG_ARGUMENTS}}}\n</tool_call>'),
        ("llama3_json", f'<|python_tag|>{{"name": "write", "parameters": {LONG_ARGUMENTS}}}'),
        ("mistral", f"[TOOL_CALLS]write[ARGS]{LONG_ARGUMENTS}"),
        ("mistral", f'[TOOL_CALLS][{{"name": "write", "arguments": {LONG_ARGUMENTS}}}]'),
    ],
)
def test_json_arguments_stream_as_written_and_equal_the_final_string(tool_format, text):
    sink, per_push, final = run_chars(text, tool_format)
    events = [e for push in per_push for e in push] + final
    # The arguments string is the model's own text of the object (spacing, escapes, number
    # forms kept), so the pieces a stream sends concatenate to exactly the whole answer's string.
    assert raw_calls(sink) == [("write", LONG_ARGUMENTS)] == streamed_calls(events)
    header, _ = header_and_argument_pushes(per_push)
    assert header == text.index(LONG_ARGUMENTS)  # the push of the arguments' `{`
    sent = 0
    for position in range(header, header + len(LONG_ARGUMENTS)):
        sent += sum(len(e.arguments) for e in per_push[position] if isinstance(e, ToolCallDelta))
        # Nothing is held back but one character that may start a marker (mistral's `[`).
        assert sent >= position - header
    assert sink.finish_reason == "tool_calls"


def test_the_header_waits_for_arguments_that_may_still_be_prose():
    # `{"name": "f"` alone is not yet a call: were generation to end here it would be content.
    sink, per_push, _ = run_chars('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes")
    assert header_and_argument_pushes(per_push)[0] == len('<tool_call>{"name": "f", "arguments": ')


def test_arguments_before_the_name_wait_for_it():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    sink, per_push, _ = run_chars(text, "hermes")
    header, pieces = header_and_argument_pushes(per_push)
    assert header == pieces[0] == text.index('"f"') + 2  # the name's closing quote
    assert raw_calls(sink) == [("f", '{"a": 1}')]


def test_a_call_without_arguments_gets_an_empty_object():
    sink, _, _ = run_chars('<tool_call>{"name": "f"}</tool_call>', "hermes")
    assert raw_calls(sink) == [("f", "{}")]


def test_arguments_cut_by_max_tokens_stay_a_call_with_what_was_streamed():
    # The header and pieces are already with the client: the whole answer reports the same call,
    # its arguments unfinished, and finish_reason "length" (not "tool_calls") says so.
    text = 'Ok.<tool_call>{"name": "f", "arguments": {"a": "long'
    sink, per_push, final = run_chars(text, "hermes", reason="length")
    events = [e for push in per_push for e in push] + final
    assert raw_calls(sink) == [("f", '{"a": "long')] == streamed_calls(events)
    assert sink.content == "Ok." and sink.finish_reason == "length"


def test_arguments_that_break_after_the_header_end_the_call_and_the_block():
    text = '<tool_call>{"name": "f", "arguments": {"a": tru}} junk</tool_call> after'
    sink, _, _ = run_chars(text, "hermes")
    assert raw_calls(sink) == [("f", '{"a": tru')]  # cut where it stopped being JSON
    assert sink.content == " after" and sink.finish_reason == "tool_calls"


def test_a_complete_call_is_kept_when_its_block_goes_wrong_after_it():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>'
    sink, _, _ = run_chars(text, "hermes")
    assert raw_calls(sink) == [("f", '{"a": 1}')] and sink.content == ""


def test_non_object_arguments_are_content():
    text = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    sink, _, _ = run_chars(text, "hermes")
    assert sink.content == text and sink.tool_calls == []


def test_string_arguments_go_out_whole_once_decoded():
    body = '{"name": "f", "arguments": "{\\"a\\": \\"x\\"}"}'
    sink, per_push, _ = run_chars(f"<tool_call>{body}</tool_call>", "hermes")
    header, pieces = header_and_argument_pushes(per_push)
    assert header == pieces[0] and len(pieces) == 1
    assert raw_calls(sink) == [("f", '{"a": "x"}')]


def test_parallel_calls_stream_one_after_the_other():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
    sink, per_push, final = run_chars(text, "hermes")
    events = [e for push in per_push for e in push] + final
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(e.index, e.name) for e in starts] == [(0, "a"), (1, "b")]
    assert streamed_calls(events) == raw_calls(sink) == [("a", '{"x": 1}'), ("b", "{}")]
    assert len({e.id for e in starts}) == 2 and [e.id for e in starts] == [c.id for c in sink.tool_calls]


def test_qwen3_coder_streams_values_that_cannot_be_json_and_encodes_as_json_dumps():
    code = 'import os\nprint("hi")\t\\ 東京\n'
    text = (
        "<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        f"<parameter=n>\n3\n</parameter>\n<parameter=body>\n{code}\n</parameter>\n</function>\n</tool_call>"
    )
    sink, per_push, final = run_chars(text, "qwen3_coder")
    events = [e for push in per_push for e in push] + final
    expected = json.dumps({"path": "/tmp/a.py", "n": 3, "body": code}, ensure_ascii=False)
    assert raw_calls(sink) == [("write", expected)] == streamed_calls(events)
    header, pieces = header_and_argument_pushes(per_push)
    assert header == text.index("<parameter=path>") + len("<parameter=path>") - 1
    body_start = text.index("import")
    assert body_start + 1 in pieces  # the code streams (a character's push sends the one before it)...
    assert text.index("3\n</parameter>") not in pieces  # ...while "3" is held until its type is known


def test_qwen3_coder_value_cut_by_max_tokens():
    text = '<tool_call>\n<function=write>\n<parameter=body>\nimport os\nprint("hi'
    sink, _, _ = run_chars(text, "qwen3_coder", reason="length")
    assert raw_calls(sink) == [("write", '{"body": "import os\\nprint(\\"hi')]
    assert sink.finish_reason == "length"


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=5),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
            max_leaves=6,
        ),
        max_size=4,
    ),
    st.sampled_from(["hermes", "llama3_json", "mistral"]),
    st.booleans(),
)
def test_any_arguments_object_streams_to_its_own_text(arguments, tool_format, compact):
    text = json.dumps(arguments, ensure_ascii=compact, separators=(",", ":") if compact else None)
    markup = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {text}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {text}}}',
        "mistral": f"[TOOL_CALLS]f[ARGS]{text}",
    }[tool_format]
    sink, per_push, final = run_chars(markup, tool_format)
    events = [e for push in per_push for e in push] + final
    assert raw_calls(sink) == [("f", text)] == streamed_calls(events)
    assert json.loads(sink.tool_calls[0].arguments) == arguments
