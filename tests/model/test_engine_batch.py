"""Continuous batching in the engine: every row of a batch equals that row generated alone."""

from __future__ import annotations

import pytest

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

PROMPTS = {
    1: [5, 17, 42, 99, 3, 250, 11, 7],
    2: [300, 2, 77],
    3: list(range(40, 140, 3)),
    4: [9] * 5 + [123, 456, 78],
    5: [31, 41, 59, 26, 53, 58, 97],
}


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine(load_model(qwen3_dir).model, eos_token_ids=[], options=EngineOptions(prefill_chunk=16))


def spec(row_id, max_tokens=24, **sampling):
    return RowSpec(row_id, tuple(PROMPTS[row_id]), SamplingParams(**sampling), max_tokens)


def solo(engine, row_id, max_tokens=24, **sampling):
    return generate_tokens(engine, [spec(row_id, max_tokens, **sampling)])[row_id]


def run_row_to_join(engine, s):
    engine.open_row(s)
    while engine.prefill(s.row_id).remaining:
        pass
    return engine.join(s.row_id).token


def test_batch_of_four_with_a_join_and_a_leave_equals_solo(engine):
    alone = {r: solo(engine, r, max_tokens=30 if r != 2 else 10) for r in (1, 2, 3, 4, 5)}
    got = {r: [] for r in alone}
    for r in (1, 2, 3, 4):  # different prompt lengths -> left padding
        got[r].append(run_row_to_join(engine, spec(r, 30 if r != 2 else 10)))
    live = {1, 2, 3, 4}
    steps = 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps == 5:  # a joiner mid-flight
            got[5].append(run_row_to_join(engine, spec(5, 30)))
            live.add(5)
    assert got == alone
    assert engine.active_rows == 0 and engine.batch_size == 0


def test_abort_mid_flight_leaves_others_exact(engine):
    alone = {r: solo(engine, r) for r in (1, 3)}
    got = {1: [run_row_to_join(engine, spec(1))], 3: [run_row_to_join(engine, spec(3))]}
    run_row_to_join(engine, spec(4))
    live = {1, 3}
    for step in range(40):
        for t in engine.step():
            if t.row_id == 4:
                continue
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        if step == 3:
            engine.close_row(4)  # an abort: the row leaves at a step boundary
        if not live:
            break
    assert got == alone


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = solo(engine, 1, **params)
    assert alone != solo(engine, 1, **{**params, "seed": 99})
    batched = generate_tokens(engine, [spec(2), spec(1, **params), spec(3, temperature=1.0, seed=5)])
    assert batched[1] == alone


def test_eos_and_length_finish(engine):
    first = solo(engine, 1, max_tokens=6)
    assert len(first) == 6
    eos_engine = Engine(engine.model, eos_token_ids=[first[2]], options=EngineOptions(prefill_chunk=16))
    stopped = generate_tokens(eos_engine, [spec(1, 20)])[1]
    assert stopped == first[:3]  # the EOS token is reported, then the row ends


def test_logprobs_are_sorted_and_consistent(engine):
    s = RowSpec(1, tuple(PROMPTS[1]), SamplingParams(logprobs=True, top_logprobs=3), 4)
    engine.open_row(s)
    while engine.prefill(1).remaining:
        pass
    outs = [engine.join(1)]
    while not outs[-1].finish:
        outs += engine.step()
    engine.close_row(1)
    for t in outs:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the top-1
        assert t.logprob == pytest.approx(values[0])


def test_a_joiner_prefilled_in_small_chunks_beside_a_running_row_equals_solo(engine):
    """The scheduler's smaller chunk while others decode (max_tokens) changes only where the
    prompt is cut, never the result: row 3 (33 prompt tokens) in 5-token chunks between steps of
    row 1 decodes exactly as when prefilled alone in 16-token chunks."""
    expected = {r: solo(engine, r) for r in (1, 3)}
    out = {1: [run_row_to_join(engine, spec(1))], 3: []}
    s = spec(3)
    engine.open_row(s)
    chunks = 0
    while True:
        progress = engine.prefill(3, max_tokens=5)
        chunks += 1
        assert progress.done == min(5 * chunks, len(PROMPTS[3]) - 1)
        for t in engine.step():
            out[t.row_id].append(t.token)
        if not progress.remaining:
            break
    assert chunks == 7
    out[3].append(engine.join(3).token)
    while any(len(out[r]) < 24 for r in out):
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
    assert out == expected
    assert engine.active_rows == 0


def test_keeping_freed_buffers_changes_no_output_and_holds_no_memory_once_rows_close(engine, monkeypatch):
    """CUDA's default (clear_cache off): MLX's freed buffers stay in its cache for
    reuse. Results are the same, and once every row is closed the active memory is back where it
    was — the kept buffers count as cache, not as memory the engine holds."""
    import gc

    import attrs
    import mlx.core as mx

    from model.engine import engine as engine_module

    expected = {r: solo(engine, r) for r in (1, 3, 4)}
    assert generate_tokens(engine, [spec(r) for r in (1, 3, 4)]) == expected  # meets B=3's shapes once
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    monkeypatch.setattr(engine, "options", attrs.evolve(engine.options, clear_cache=False))
    monkeypatch.setattr(engine_module, "CLEAR_CACHE_EVERY", 4)
    for _ in range(2):
        assert generate_tokens(engine, [spec(r) for r in (1, 3, 4)]) == expected
        assert engine.active_rows == 0
        gc.collect()  # arrays held only by reference cycles are not the engine's
        assert mx.get_active_memory() == before
    assert mx.get_cache_memory() > 0  # what the engine released is kept for reuse


def test_rows_closed_between_two_steps_leave_the_kv_in_one_filter_and_the_rest_stay_exact(engine, monkeypatch):
    """Three of five rows closed together (a group finishing, or aborts) are dropped from the
    batch's KV by one filter at the next step, not one copy of the whole batch each; the rows
    left decode exactly as alone, and closing the last rows frees the batch at once."""
    from model.kv import cache as kv_cache

    alone = {r: solo(engine, r) for r in (3, 5)}
    got = {r: [] for r in PROMPTS}
    for r in PROMPTS:
        got[r].append(run_row_to_join(engine, spec(r)))
    for _ in range(3):
        for t in engine.step():
            got[t.row_id].append(t.token)
    filters = []
    real_filter = kv_cache.BatchKVCache.filter
    monkeypatch.setattr(
        kv_cache.BatchKVCache, "filter", lambda self, keep: (filters.append(list(keep)), real_filter(self, keep))
    )
    for r in (1, 2, 4):
        engine.close_row(r)
    assert engine.batch_size == 2 and filters == []  # nothing copied yet
    while len(got[3]) < 24 or len(got[5]) < 24:
        for t in engine.step():
            assert t.row_id in (3, 5), t
            got[t.row_id].append(t.token)
    # one filter per layer, keeping rows 3 and 5 (batch positions 2 and 4)
    assert filters == [[2, 4]] * engine.num_layers, filters
    assert {r: got[r] for r in (3, 5)} == alone
    engine.close_row(3)
    engine.close_row(5)
    assert engine.batch_size == 0 and engine._caches == []  # the last leave frees the KV now


def test_one_token_prompt_with_penalties_joins_a_group(engine):
    """A one-token prompt joining through join_group starts with an empty penalty history: it
    must stay an integer array (an empty float one broke the gather of every later step)."""
    from tests.engine_helpers import decode_to_the_end

    penalties = dict(temperature=0.5, seed=4, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    alone = generate_tokens(engine, [RowSpec(2, (121,), SamplingParams(**penalties), 6)])[2]
    engine.open_row(RowSpec(5, (121,), SamplingParams(**penalties), 6))
    assert engine.join_group([5]) == [None]
    out = decode_to_the_end(engine, {5: []}, {5})
    assert out[5] == alone
