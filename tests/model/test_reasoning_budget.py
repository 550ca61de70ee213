"""The reasoning budget in the engine: a row reasoning from its first token is cut after N
reasoning tokens by the forced close marker and separator, then goes on as the model continues
from them; solo, batched beside unbudgeted rows (which equal their solo runs), with
speculation, and seeded. The markers are plain token ids here (the tiny model never emits them),
so the row would otherwise reason until max_tokens."""

from __future__ import annotations

import attrs
import pytest

from model.engine.engine import Engine
from model.engine.params import SamplingParams, ThinkControl
from model.engine.reasoning import ThinkTracker
from model.engine.rows import RowSpec
from model.engine.speculation import Speculation
from model.load.loader import load_model
from tests.engine_helpers import generate_tokens

OPEN, CLOSE, SEPARATOR = 3, 4, (5, 6)
PROMPTS = [[17, 42, 99, 250, 11, 7, 3], [300, 2, 77, 3], [(i * 37) % 400 + 9 for i in range(60)] + [3]]
N = 24


def thinking(budget: int | None, **kw) -> ThinkControl:
    return ThinkControl(OPEN, CLOSE, SEPARATOR, starts_in_reasoning=True, budget=budget, **kw)


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return load_model(qwen3_dir).model


def solo(model, prompt, sampling, n=N, **engine_kw) -> list[int]:
    return generate_tokens(Engine(model, eos_token_ids=[], **engine_kw), [RowSpec(0, tuple(prompt), sampling, n)])[0]


def test_the_tracker_counts_reasoning_and_forces_the_close_then_the_separator():
    tracker = ThinkTracker.start(ThinkControl(OPEN, CLOSE, SEPARATOR, budget=2))
    assert [tracker.step(t) for t in (9, OPEN, 10, 11)] == [False, False, True, True]
    assert tracker.forced() == CLOSE and tracker.count == 2
    assert not tracker.step(CLOSE) and tracker.forced() == SEPARATOR[0]
    tracker.step(SEPARATOR[0])
    assert tracker.forced() == SEPARATOR[1]
    tracker.step(SEPARATOR[1])
    assert tracker.done and tracker.forced() is None
    # a natural close ends it without a forced separator (no constraint waits for the answer)
    natural = ThinkTracker.start(thinking(budget=5))
    natural.step(10)
    natural.step(CLOSE)
    assert natural.done and natural.count == 1
    # what a verification step would emit: samples, with the forced tokens in their place
    cut = ThinkTracker.start(thinking(budget=1))
    assert cut.forced_along([10, 11, 12, 13, 14]) == [10, CLOSE, *SEPARATOR, 14]
    assert cut.seen == 0 and cut.count == 0  # (a trial: the tracker itself is unchanged)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_a_budget_cuts_the_reasoning_and_the_row_goes_on_from_the_forced_tokens(model, budget):
    free = solo(model, PROMPTS[0], SamplingParams())
    assert CLOSE not in free and OPEN not in free  # (the markers are ids this model never picks)
    cut = solo(model, PROMPTS[0], SamplingParams(think=thinking(budget)))
    assert cut[:budget] == free[:budget]
    assert cut[budget : budget + 3] == [CLOSE, *SEPARATOR]
    # after the forced tokens the model goes on as it would from a prompt that holds them
    head = cut[: budget + 3]
    rest = solo(model, PROMPTS[0] + head, SamplingParams(), n=N - len(head))
    assert cut[budget + 3 :] == rest


def test_budgeted_rows_batched_beside_unbudgeted_ones_equal_their_solo_runs(model):
    specs, expected = [], {}
    for i, prompt in enumerate(PROMPTS * 2):
        sampling = SamplingParams(think=thinking(3 + i)) if i % 2 else SamplingParams()
        specs.append(RowSpec(i, tuple(prompt), sampling, N))
        expected[i] = solo(model, prompt, sampling)
    batched = generate_tokens(Engine(model, eos_token_ids=[]), specs)
    assert batched == expected
    assert all(CLOSE in batched[i] for i in range(1, len(specs), 2))


def test_seeded_sampled_rows_keep_their_tokens_with_a_budget(model):
    sampling = SamplingParams(temperature=0.9, seed=77, think=thinking(5))
    first = solo(model, PROMPTS[1], sampling)
    free = solo(model, PROMPTS[1], SamplingParams(temperature=0.9, seed=77))
    assert first[:5] == free[:5] and first[5:8] == [CLOSE, *SEPARATOR]
    specs = [RowSpec(0, tuple(PROMPTS[1]), sampling, N), RowSpec(1, tuple(PROMPTS[0]), SamplingParams(), N)]
    assert generate_tokens(Engine(model, eos_token_ids=[]), specs)[0] == first


@pytest.mark.parametrize("budget", [0, 2, 9])
def test_speculation_emits_the_forced_tokens_where_plain_decoding_does(model, qwen3_dir, budget):
    # The target drafting for itself: its drafts are the unforced continuation, so every step
    # drafts, and the one that reaches the budget must reject them for the forced tokens.
    drafting = Speculation("draft", 3, always=True, draft_model=load_model(qwen3_dir).model)
    sampling = SamplingParams(think=thinking(budget))
    engine = Engine(model, eos_token_ids=[], speculation=drafting)
    specs = [RowSpec(i, tuple(p), sampling, N) for i, p in enumerate(PROMPTS)]
    specs.append(RowSpec(len(PROMPTS), tuple(PROMPTS[0]), SamplingParams(), N))  # an unbudgeted row beside them
    engine.open_row(specs[0])
    while engine.prefill(0).remaining:
        pass
    outs = [engine.join(0)]
    while not outs[-1].finish:
        outs += engine.step()
    engine.close_row(0)
    assert [t.token for t in outs] == solo(model, PROMPTS[0], sampling)
    assert sum(t.drafted for t in outs) > 0
    batched = generate_tokens(engine, [attrs.evolve(s, row_id=s.row_id + 10) for s in specs])
    expected = [solo(model, s.prompt, s.sampling) for s in specs]
    assert [batched[s.row_id + 10] for s in specs] == expected


@pytest.mark.parametrize("k", [2, 5, 9])
def test_a_resumed_row_goes_on_with_its_reasoning_where_it_stopped(model, k):
    # A preempted row reopens with what it generated appended to its prompt (RowSpec.resumed):
    # its reasoning count and any forced tokens still due go on from there.
    sampling = SamplingParams(temperature=0.9, seed=5, think=thinking(4))
    whole = solo(model, PROMPTS[0], sampling)
    resumed = RowSpec(0, tuple(PROMPTS[0] + whole[:k]), sampling, N - k, resumed=k)
    assert generate_tokens(Engine(model, eos_token_ids=[]), [resumed])[0] == whole[k:]
