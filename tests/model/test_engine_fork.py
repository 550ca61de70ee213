"""`Engine.fork_rows`: a request's choices forward their prompt once, then each decodes as a row
of its own, equal to the same row run alone (tiny real model, CPU)."""

from __future__ import annotations

import pytest

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import decode_to_the_end, generate_tokens

PROMPT = (5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 9, 31, 77, 2, 300, 45, 8, 19, 23, 61)
OTHER = (300, 2, 77, 5, 6)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(load_model(qwen3_dir).model, eos_token_ids=[], options=EngineOptions(prefill_chunk=8))


def spec(row_id, prompt=PROMPT, max_tokens=16, **sampling):
    return RowSpec(row_id, prompt, SamplingParams(**sampling), max_tokens)


def prefill(engine, s):
    engine.open_row(s)
    while engine.prefill(s.row_id).remaining:
        pass


def run_family(engine, specs, running=None):
    """The first spec prefills, the others fork from it and ride the next step; `running` holds
    the tokens so far of rows already decoding. Everything to the end: {row: tokens}."""
    leader, *rest = specs
    prefill(engine, leader)
    opened = engine.fork_rows(leader.row_id, rest)
    assert [o.to_prefill for o in opened] == [0] * len(rest)
    first = engine.join(leader.row_id)
    out = (running or {}) | {leader.row_id: [first.token]} | {s.row_id: [] for s in rest}
    assert engine.join_group([s.row_id for s in rest]) == [None] * len(rest)
    return decode_to_the_end(engine, out, set(out))


def test_greedy_choices_equal_the_solo_run_and_prefill_the_prompt_once(engine):
    alone = generate_tokens(engine, [spec(1)])[1]
    before = engine.prefill_tokens
    out = run_family(engine, [spec(10), spec(11), spec(12)])
    assert out == {10: alone, 11: alone, 12: alone}
    assert engine.prefill_tokens - before == len(PROMPT) - 1  # one prefill, not three
    assert engine.active_rows == 0


def test_sampled_choices_each_equal_a_solo_run_with_their_own_seed(engine):
    sampling = {"temperature": 1.0}
    alone = {s: generate_tokens(engine, [spec(1, seed=s, **sampling)])[1] for s in (7, 8, 9)}
    out = run_family(engine, [spec(20 + i, seed=s, **sampling) for i, s in enumerate((7, 8, 9))])
    assert out == {20: alone[7], 21: alone[8], 22: alone[9]}
    assert len({tuple(t) for t in out.values()}) == 3  # different seeds, different choices


def test_forked_rows_batched_with_other_rows_equal_solo(engine):
    alone = generate_tokens(engine, [spec(1)])[1]
    other_alone = generate_tokens(engine, [spec(2, OTHER, max_tokens=24)])[2]
    prefill(engine, spec(30, OTHER, max_tokens=24))
    out = {30: [engine.join(30).token]}
    for t in engine.step() + engine.step():  # decoding before the family arrives
        out[30].append(t.token)
    out = run_family(engine, [spec(31), spec(32)], running=out)
    assert out == {30: other_alone, 31: alone, 32: alone}


def test_fork_refuses_a_source_mid_prefill_or_joined_and_a_different_prompt(engine):
    engine.open_row(spec(40))
    engine.prefill(40)  # 8 of 19 tokens
    with pytest.raises(RuntimeError):
        engine.fork_rows(40, [spec(41)])
    while engine.prefill(40).remaining:
        pass
    with pytest.raises(ValueError):
        engine.fork_rows(40, [spec(41), spec(42, OTHER)])
    assert engine.active_rows == 1  # all or nothing
    engine.join(40)
    with pytest.raises(RuntimeError):
        engine.fork_rows(40, [spec(41)])
    engine.close_row(40)
    assert engine.active_rows == 0
