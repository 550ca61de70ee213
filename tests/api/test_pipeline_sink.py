"""The whole per-token pipeline of one completion (CompletionSink)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from api.pipeline.events import TextDelta, ToolCallDelta, ToolCallsEvent, ToolCallStart
from api.pipeline.sink import CompletionSink


class FakeDetokenizer:
    """Token id i decodes to pieces[i]; bytes pieces can split a UTF-8 character, which the
    decoder then holds until the next token or `finalize`, like a real streaming detokenizer."""

    def __init__(self, pieces: Sequence[str | bytes]) -> None:
        self._table = [p.encode() if isinstance(p, str) else p for p in pieces]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def add_token(self, token_id: int) -> None:
        self._pending += self._decoder.decode(self._table[token_id])

    @property
    def last_segment(self) -> str:
        segment, self._pending = self._pending, ""
        return segment

    def finalize(self) -> None:
        self._pending += self._decoder.decode(b"", final=True)


def stream(pieces, **options):
    """Push every piece; return the sink and the events of each push."""
    sink = CompletionSink(FakeDetokenizer(pieces), **options)
    per_push = []
    for token_id in range(len(pieces)):
        per_push.append(sink.push(token_id))
        if sink.stopped:
            break
    return sink, per_push


def texts(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def calls_of(sink):
    return [(call.name, json.loads(call.arguments)) for call in sink.tool_calls]


def streamed_calls(events) -> list[tuple[str, str]]:
    """(name, arguments) per call as a stream client assembles them from headers and deltas."""
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        elif isinstance(event, ToolCallDelta):
            assert event.index == len(calls) - 1  # only the open call grows
            calls[event.index][1] += event.arguments
    return [(name, arguments) for name, arguments in calls]


def test_finish_reason_follows_the_cause_and_tool_calls():
    eos, _ = stream(["hi"])
    eos.finish(reason="eos")
    length, _ = stream(["hi"])
    length.finish(reason="length")
    tools, _ = stream(
        ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'],
        tool_format="hermes",
        tools_present=True,
    )
    tools.finish(reason="eos")
    assert (eos.finish_reason, length.finish_reason, tools.finish_reason) == (
        "stop",
        "length",
        "tool_calls",
    )


def test_tool_calls_event_comes_once_and_last():
    sink, per_push = stream(
        ["Checking.", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'],
        tool_format="hermes",
        tools_present=True,
    )
    assert not any(isinstance(e, ToolCallsEvent) for events in per_push for e in events)
    final = sink.finish(reason="eos")
    assert isinstance(final[-1], ToolCallsEvent)
    assert final[-1].calls == tuple(sink.tool_calls)
    assert calls_of(sink) == [("f", {"a": 1})]


def test_deltas_add_up_to_content_and_reasoning():
    sink, per_push = stream(["<think>r1", " r2</think>c1", " c2"], think=True)
    events = [e for events in per_push for e in events] + sink.finish(reason="eos")
    assert "".join(e.text for e in events if e.kind == "reasoning") == sink.reasoning == "r1 r2"
    assert "".join(e.text for e in events if e.kind == "content") == sink.content == "c1 c2"


def test_one_push_coalesces_same_kind_deltas():
    sink, per_push = stream(["<think>a</think>b<think>c</think>d"], think=True)
    assert [(e.kind, e.text) for e in per_push[0]] == [
        ("reasoning", "a"),
        ("content", "b"),
        ("reasoning", "c"),
        ("content", "d"),
    ]


def test_finish_twice_is_a_bug():
    sink, _ = stream(["x"])
    sink.finish(reason="eos")
    try:
        sink.finish(reason="eos")
    except RuntimeError:
        return
    raise AssertionError("second finish() was accepted")


# --- split invariance ------------------------------------------------------------------------

_FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    '{"name": "f", "arguments": {"x": "é"}}',
    "<function=g>",
    "<parameter=k>",
    "\n7\n",
    "</parameter>",
    "</function>",
    "f[ARGS]",
    '{"y": 2}',
    '{"name": "g", "arguments": ',
    '"parameters": ',
    '"s"',
    "}",
    ",",
    '"',
    "\\",
    "-1.5",
    "tru",
    "<",
    "</",
    "think",
    "tool",
    ">",
    "STOP",
    "ST",
    "OP",
    "END",
    "a",
    " ",
    "\n",
    "é",
    "{",
    "[",
    "]",
]

_CONFIGS = [
    {},
    {"stop": ["STOP", "OP a", "\n\n"]},
    {"think": True},
    {"starts_in_reasoning": True, "stop": ["STOP", "OP a"]},
    {"think": True, "stop": ["END"], "tool_format": "hermes", "tools_present": True},
    {"tool_format": "qwen3_coder", "tools_present": True, "stop": ["STOP"]},
    {"tool_format": "llama3_json", "tools_present": True},
    {"tool_format": "mistral", "tools_present": True, "think": True},
]


def _run(pieces, options, reason):
    sink = CompletionSink(FakeDetokenizer(pieces), **options)
    events = []
    for token_id in range(len(pieces)):
        events += sink.push(token_id)
        if sink.stopped:
            break
    events += sink.finish(reason="stop" if sink.stopped else reason)
    return sink, events


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_FRAGMENTS), max_size=25).map("".join),
    st.lists(st.integers(0, 10_000), max_size=12),
    st.sampled_from(_CONFIGS),
    st.sampled_from(["eos", "length"]),
)
def test_any_token_split_gives_the_unsplit_result(text, cuts, options, reason):
    # Cutting the UTF-8 bytes anywhere also splits multi-byte characters across tokens.
    data = text.encode()
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:])]

    whole, _ = _run([data], options, reason)
    split, events = _run(pieces, options, reason)

    assert (split.content, split.reasoning) == (whole.content, whole.reasoning)
    raw_calls = [(call.name, call.arguments) for call in split.tool_calls]
    assert raw_calls == [(call.name, call.arguments) for call in whole.tool_calls]
    assert streamed_calls(events) == raw_calls  # the stream carried exactly the final calls
    assert (split.matched_stop, split.finish_reason) == (whole.matched_stop, whole.finish_reason)
    assert "".join(e.text for e in events if getattr(e, "kind", "") == "content") == split.content
    assert "".join(e.text for e in events if getattr(e, "kind", "") == "reasoning") == split.reasoning
    if not options:
        assert split.content == text
    if set(options) == {"stop"}:
        # With think tags or tool markup removed, text that was apart in the raw stream can meet.
        assert not any(stop in split.content for stop in options["stop"])


TWO_CALLS = [
    "<tool_call>",
    '{"name": "f", "arguments": {"a": 1}}',
    "</tool_call>",
    "\n<tool_call>",
    '{"name": "g", "arguments": {}}',
    "</tool_call>",
]


def test_parallel_tool_calls_false_keeps_the_first_call_and_stops_after_it():
    both, _ = stream(TWO_CALLS, tool_format="hermes", tools_present=True)
    both.finish(reason="eos")
    assert [name for name, _ in calls_of(both)] == ["f", "g"]

    sink, per_push = stream(TWO_CALLS, tool_format="hermes", tools_present=True, parallel_tool_calls=False)
    assert sink.stopped and len(per_push) == 2  # stopped once the first call is whole: generation ends
    events = [e for push in per_push for e in push] + sink.finish(reason="stop")
    assert calls_of(sink) == [("f", {"a": 1})] and sink.finish_reason == "tool_calls"
    assert streamed_calls(events) == [("f", '{"a": 1}')]
    assert [e.calls for e in events if isinstance(e, ToolCallsEvent)] == [tuple(sink.tool_calls)]
    # another choice of the same request is configured the same way
    other = sink.fresh(FakeDetokenizer(TWO_CALLS))
    for token_id in range(len(TWO_CALLS)):
        other.push(token_id)
    other.finish(reason="stop")
    assert [call.name for call in other.tool_calls] == ["f"]


def test_a_single_call_cut_at_the_end_is_still_reported():
    pieces = ["<tool_call>", '{"name": "f", "arguments": {"a": 1']
    sink, _ = stream(pieces, tool_format="hermes", tools_present=True, parallel_tool_calls=False)
    sink.finish(reason="length")
    assert [call.name for call in sink.tool_calls] == ["f"] and sink.finish_reason == "length"
