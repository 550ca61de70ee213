"""Stop strings: matched on decoded text across tokens, nothing from the match on is emitted."""

from __future__ import annotations

import pytest
from test_pipeline_sink import stream, texts

from api.pipeline.stop import StopMatcher


def test_stop_string_split_across_tokens_is_never_emitted():
    sink, per_push = stream(["Hello wo", "rld! ST", "OP after"], stop=["STOP"])
    assert sink.stopped and sink.matched_stop == "STOP"
    assert [texts(events) for events in per_push] == ["Hello wo", "rld! ", ""]
    assert texts(sink.finish(reason="stop")) == ""
    assert sink.content == "Hello world! "
    assert sink.finish_reason == "stop"


def test_stop_string_inside_reasoning_stops_generation():
    sink, per_push = stream(["<think>", "plan ", "EN", "D more</think>", "answer"], stop=["END"], think=True)
    assert sink.stopped and len(per_push) == 4
    sink.finish(reason="stop")
    assert (sink.reasoning, sink.content) == ("plan ", "")


def test_earliest_completed_stop_wins():
    sink, _ = stream(["hello world"], stop=["world", "lo w"])
    assert sink.matched_stop == "lo w"
    assert sink.content == "hel"


def test_earliest_stop_is_the_same_however_the_text_is_split():
    whole = StopMatcher(["abcd", "bc"])
    assert whole.feed("xabcd") == "xa" and whole.matched == "bc"
    split = StopMatcher(["abcd", "bc"])
    assert "".join(split.feed(ch) for ch in "xabcd") == "xa" and split.matched == "bc"


def test_stops_completing_at_the_same_place_prefer_the_longer_one():
    matcher = StopMatcher(["cd", "bcd"])
    assert matcher.feed("abcde") == "a" and matcher.matched == "bcd"


def test_partial_stop_prefix_is_held_back_then_released_at_finish():
    sink, per_push = stream(["answer S", "T"], stop=["STOP"])
    assert [texts(events) for events in per_push] == ["answer ", ""]
    assert texts(sink.finish(reason="eos")) == "ST"
    assert not sink.stopped and sink.matched_stop is None
    assert sink.content == "answer ST"


def test_stop_discards_text_still_held_by_the_detokenizer():
    # "\xc3" starts a two-byte character: the detokenizer holds it until finalize.
    pieces = [b"ok ", b"STOP\xc3"]
    stopped, _ = stream(pieces, stop=["STOP"])
    stopped.finish(reason="stop")
    assert stopped.content == "ok "
    unstopped, _ = stream(pieces, stop=["NOPE"])
    unstopped.finish(reason="eos")
    assert unstopped.content == "ok STOP\ufffd"


def test_stop_discards_tool_markup_that_follows_the_match():
    sink, _ = stream(
        ['x STOP<tool_call>{"name": "f", "arguments": {}}</tool_call>'],
        stop=["STOP"],
        tool_format="hermes",
        tools_present=True,
    )
    events = sink.finish(reason="stop")
    assert sink.content == "x " and sink.tool_calls == [] and events == []
    assert sink.finish_reason == "stop"


def test_empty_stop_strings_are_ignored():
    sink, _ = stream(["abc"], stop=["", "zz"])
    sink.finish(reason="eos")
    assert sink.content == "abc" and not sink.stopped


def test_tokens_pushed_after_a_stop_are_ignored():
    sink, _ = stream(["aSTOP"], stop=["STOP"])
    assert sink.push(0) == []
    assert sink.content == "a"


@pytest.mark.parametrize("stop", [["\n\n"], ["</think>"]])
def test_stop_matches_on_raw_text_before_think_tags_are_stripped(stop):
    sink, _ = stream(["<think>a</think>", "\n\nb"], stop=stop, think=True)
    sink.finish(reason="stop")
    assert sink.stopped
    assert sink.reasoning == "a"
    assert sink.content == ""
