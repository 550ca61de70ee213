"""Group prefill: several freshly opened rows prefilled in one right-padded forward decode
exactly as when each is prefilled alone; rows it cannot take are left untouched."""

from __future__ import annotations

import pytest

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import decode_to_the_end, generate_tokens


def specs(n: int, max_tokens: int = 12) -> list[RowSpec]:
    # distinct lengths (so padding differs per row) and distinct contents
    return [
        RowSpec(i, tuple((7 * i + 3 * j) % 200 + 4 for j in range(9 + 5 * i)), SamplingParams(), max_tokens)
        for i in range(1, n + 1)
    ]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_group_prefill_decodes_like_solo_prefill(tiny_model_factory, family):
    # no buckets: one forward for all rows, each padded up to the longest (buckets:
    # test_engine_prefill_bucket.py)
    loaded = load_model(tiny_model_factory(family))
    rows = specs(5)
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[], options=EngineOptions(prefill_bucket=0)), rows)
    engine = Engine(loaded.model, eos_token_ids=[], options=EngineOptions(group_bucket=0))
    for spec in rows:
        engine.open_row(spec)
    assert all(engine.groupable(s.row_id) for s in rows)
    progress = engine.prefill_group([s.row_id for s in rows])
    assert [p.remaining for p in progress] == [0] * len(rows)
    assert [p.done for p in progress] == [len(s.prompt) - 1 for s in rows]
    out = {s.row_id: [engine.join(s.row_id).token] for s in rows}
    assert decode_to_the_end(engine, out, {s.row_id for s in rows}) == expected


def test_group_prefill_refuses_rows_it_cannot_take(qwen3_dir):
    engine = Engine(load_model(qwen3_dir).model, eos_token_ids=[], options=EngineOptions(prefill_chunk=16))
    short, long_ = specs(1)[0], RowSpec(9, tuple(range(5, 40)), SamplingParams(), 4)
    engine.open_row(short)
    engine.open_row(long_)
    assert engine.groupable(short.row_id) and not engine.groupable(long_.row_id)  # over one chunk
    progress = engine.prefill_group([long_.row_id, short.row_id])
    assert [(p.row_id, p.remaining) for p in progress] == [(long_.row_id, len(long_.prompt) - 1), (short.row_id, 0)]
    assert not engine.groupable(short.row_id)  # already prefilled
    while engine.prefill(long_.row_id).remaining:  # the one left out prefills alone as usual
        pass
    assert engine.join(long_.row_id).row_id == long_.row_id


def run_grouped(engine: Engine, rows: list[RowSpec], *, running: RowSpec | None = None) -> dict[int, list[int]]:
    """Optionally one row already decoding; then `rows` group-prefilled and joined in one call."""
    out: dict[int, list[int]] = {}
    live: set[int] = set()
    if running is not None:
        engine.open_row(running)
        while engine.prefill(running.row_id).remaining:
            pass
        out[running.row_id] = [engine.join(running.row_id).token]
        live.add(running.row_id)
        for t in engine.step():
            out[t.row_id].append(t.token)
    for spec in rows:
        engine.open_row(spec)
    engine.prefill_group([s.row_id for s in rows])
    for spec, first in zip(rows, engine.join_group([s.row_id for s in rows])):
        out[spec.row_id] = [] if first is None else [first.token]
        live.add(spec.row_id)
    return decode_to_the_end(engine, out, live)


@pytest.mark.parametrize("already_running", [False, True])
def test_join_group_gives_each_row_its_solo_tokens(qwen3_dir, already_running):
    loaded = load_model(qwen3_dir)
    rows = specs(4)
    # a sampled row with a seed and a repetition penalty: token 0 must see the same history
    rows.append(RowSpec(9, tuple(range(20, 41)), SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3), 10))
    running = RowSpec(50, tuple(range(60, 75)), SamplingParams(), 30) if already_running else None
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[]), rows + ([running] if running else []))
    got = run_grouped(Engine(loaded.model, eos_token_ids=[]), rows, running=running)
    assert got == expected


def test_join_group_ends_a_one_token_row_after_its_first_step(qwen3_dir):
    loaded = load_model(qwen3_dir)
    rows = [RowSpec(1, tuple(range(5, 15)), SamplingParams(), 1), RowSpec(2, tuple(range(7, 19)), SamplingParams(), 5)]
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[]), rows)
    assert run_grouped(Engine(loaded.model, eos_token_ids=[]), rows) == expected


@pytest.mark.parametrize("already_running", [False, True])
def test_join_group_of_one_row(qwen3_dir, already_running):
    loaded = load_model(qwen3_dir)
    rows = specs(1)
    running = RowSpec(50, tuple(range(60, 75)), SamplingParams(), 20) if already_running else None
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[]), rows + ([running] if running else []))
    assert run_grouped(Engine(loaded.model, eos_token_ids=[]), rows, running=running) == expected
