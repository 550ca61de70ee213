"""`<think>` splitting into reasoning vs content."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import TextStateMachine
from test_pipeline_sink import stream, texts

from api.pipeline.think import ThinkSplitter, prompt_ends_in_open_think


def split_all(pieces, *, starts_in_reasoning=False):
    splitter = ThinkSplitter(starts_in_reasoning=starts_in_reasoning)
    deltas = [d for piece in pieces for d in splitter.feed(piece)] + splitter.flush()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    return reasoning, content


def test_think_block_goes_to_reasoning_and_the_rest_to_content():
    sink, _ = stream(["<think>", "weigh options", "</think>", "Answer."], think=True)
    sink.finish(reason="eos")
    assert (sink.reasoning, sink.content) == ("weigh options", "Answer.")


def test_tags_split_across_tokens_are_recognised_and_never_leak():
    sink, per_push = stream(["<th", "ink>abc</th", "ink>", "\n\nhi"], think=True)
    sink.finish(reason="eos")
    leaked = "".join(texts(events) for events in per_push)
    assert "<" not in leaked and ">" not in leaked
    # mlx-lm's TextStateMachine keeps the "\n\n" after </think>; so do we.
    assert (sink.reasoning, sink.content) == ("abc", "\n\nhi")


def test_prompt_that_ends_in_open_think_starts_in_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert prompt_ends_in_open_think(prompt)
    sink, per_push = stream(["step one", "</think>", "done"], starts_in_reasoning=prompt_ends_in_open_think(prompt))
    assert [(e.kind, e.text) for e in per_push[0]] == [("reasoning", "step one")]
    sink.finish(reason="eos")
    assert (sink.reasoning, sink.content) == ("step one", "done")


def test_prompt_open_think_detection():
    assert not prompt_ends_in_open_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_open_think("plain prompt")
    assert prompt_ends_in_open_think("<think>old</think> then <think>")
    assert prompt_ends_in_open_think("<|im_start|>assistant\n<think>\n\n")


def test_a_think_tag_quoted_in_a_message_does_not_open_reasoning():
    prompt = "<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
    assert not prompt_ends_in_open_think(prompt)


def test_without_think_the_tags_are_ordinary_content():
    sink, _ = stream(["<think>x</think>y"])
    sink.finish(reason="eos")
    assert (sink.reasoning, sink.content) == ("", "<think>x</think>y")


def test_a_partial_tag_at_the_end_is_released_as_text():
    sink, per_push = stream(["abc <th"], think=True)
    assert texts(per_push[0]) == "abc "
    sink.finish(reason="length")
    assert sink.content == "abc <th"


def test_a_lone_less_than_is_only_held_until_it_cannot_be_a_tag():
    sink, per_push = stream(["a <", " b"], think=True)
    assert [texts(events) for events in per_push] == ["a ", "< b"]


def test_unclosed_reasoning_stays_reasoning():
    assert split_all(["<think>still going"]) == ("still going", "")


_fragments = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n", " "])


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@given(st.lists(_fragments, max_size=30).map("".join), st.lists(st.integers(0, 200), max_size=10))
def test_split_matches_mlx_lm_text_state_machine(text, cuts):
    machine = TextStateMachine({"normal": [("<think>", "reasoning")], "reasoning": [("</think>", "normal")]})
    state = machine.make_state("normal")
    got = {"reasoning": "", "normal": ""}
    for piece in _pieces(text, cuts):
        state, segments = TextStateMachine.split(state, piece)
        for name, segment in segments:
            got[name] += segment
    state, rest, name = TextStateMachine.flush(state)
    got[name] += rest
    assert split_all(_pieces(text, cuts)) == (got["reasoning"], got["normal"])
