"""Gemma 3 text (interleaved sliding-window and global attention): greedy tokens equal mlx-lm's
past the window; batched, grouped, speculative and cache-hit rows equal a solo cold run; a
wrapped sliding cache is never trimmed (a hit that needs it is a miss); a real server answers."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
import trio

from cache.prompt_cache import PromptCache
from model.engine.speculation import Speculation
from model.kv.cache import KVCache
from model.kv.rotating import BatchRotatingKVCache, RotatingKVCache
from model.load.loader import load_model
from tests.engine_helpers import generate_tokens
from tests.helpers.gemma import engine_for, run_cached, run_row_to_join, spec
from tests.helpers.parity import ours, reference
from tests.realserver import complete_whole, real_server

WINDOW = 16  # the fixture's sliding_window; layers 1 and 3 of 4 are global (pattern 2)
TINY = {"num_hidden_layers": 4, "head_dim": 16}
Q4 = {**TINY, "quant": "q4"}
LONG = [(i * 37) % 400 + 3 for i in range(40)]  # 40 prompt + 32 generated tokens: past the window
PROMPTS = [[5, 17, 42, 99, 3, 250, 11, 7], [300, 2, 77], LONG, [(i * 13) % 400 + 3 for i in range(200)]]


@pytest.fixture(scope="module")
def gemma_dir(tiny_model_factory):
    return tiny_model_factory("gemma3_text", **TINY)


# -- parity with mlx-lm -------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [TINY, Q4], ids=["fp32", "q4"])
def test_greedy_matches_mlx_lm_past_the_window(tiny_model_factory, kw):
    model_dir = tiny_model_factory("gemma3_text", **kw)
    got = ours(model_dir, PROMPTS)
    assert got == reference(model_dir, PROMPTS)
    assert all(len(set(seq)) > 4 for seq in got)  # not a degenerate repeat: the check can fail
    # Chunked prefill: chunks wider than the window, and chunks after it wrapped.
    assert ours(model_dir, PROMPTS[2:], prefill_chunk=WINDOW + 4) == reference(
        model_dir, PROMPTS[2:], prefill_chunk=WINDOW + 4
    )


def test_sliding_layers_get_rotating_caches_and_the_window_matters(gemma_dir):
    model = load_model(gemma_dir).model
    kinds = [type(c) for c in model.make_caches()]
    assert kinds == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    windowed = generate_tokens(engine_for(model), [spec(0, LONG)])[0]
    model.make_caches = lambda: [KVCache() for _ in model.layers]  # every layer global
    assert generate_tokens(engine_for(model), [spec(0, LONG)])[0] != windowed


# -- the caches ----------------------------------------------------------------------------------


def test_a_rotating_cache_trims_only_while_it_holds_a_whole_window():
    def kv(n):
        return mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4))

    cache = RotatingKVCache(WINDOW)
    cache.update_and_fetch(*kv(10))
    assert cache.is_trimmable() and cache.trim(3) == 3 and cache.offset == 7
    cache.update_and_fetch(*kv(30))  # a chunk past the window: all of it held, in order
    assert not cache.is_trimmable() and cache.trim(5) == 5 and cache.offset == 32
    cache.update_and_fetch(*kv(1))  # a decode step: the ring of WINDOW slots
    assert cache.keys.shape[2] == WINDOW and cache.trim(1) == 0 and cache.offset == 33


def test_a_batch_window_counts_positions_not_speculative_holes():
    def kv(rows, n):
        return mx.zeros((rows, 1, n, 4)), mx.zeros((rows, 1, n, 4))

    solos = [RotatingKVCache(WINDOW), RotatingKVCache(WINDOW)]
    for c, n in zip(solos, (20, 7)):
        c.update_and_fetch(*kv(1, n))
    batch = BatchRotatingKVCache.merge(solos)  # row 0 keeps its last WINDOW positions
    batch.update_and_fetch(*kv(2, 4))
    batch.reject([1, 4], 4)  # row 0 keeps 1 of 4 drafts: 3 holes inside its window
    visible = mx.sum(batch.make_mask(1), axis=-1).reshape(-1).tolist()
    assert visible == [WINDOW, 12]  # positions 6..21 of row 0; all 11 + 1 of row 1
    assert batch.extract(0).offset == 21 and batch.extract(1).offset == 11


def test_a_batch_drops_slots_outside_every_window(gemma_dir):
    engine = engine_for(load_model(gemma_dir).model)
    specs = [spec(1, LONG, 48), spec(2, PROMPTS[1], 48)]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    out = {s.row_id: [run_row_to_join(engine, s)] for s in specs}
    for _ in range(40):
        for t in engine.step():
            out[t.row_id].append(t.token)
    sliding = engine._caches[0]
    assert isinstance(sliding, BatchRotatingKVCache)
    assert sliding._idx < 3 * WINDOW + 2  # 80+ positions fed, a bounded number of slots held
    while engine.batch_size:
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
    assert out == alone


# -- batching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [TINY, Q4], ids=["fp32", "q4"])
def test_batch_with_joins_and_leaves_equals_solo(tiny_model_factory, kw):
    engine = engine_for(load_model(tiny_model_factory("gemma3_text", **kw)).model, options={"prefill_chunk": 16})
    prompts = {1: PROMPTS[0], 2: PROMPTS[1], 3: LONG, 4: [9] * 5 + [123, 456, 78], 5: LONG[:23], 6: [31, 41, 59]}
    lengths = {1: 32, 2: 10, 3: 32, 4: 24, 5: 32, 6: 20}
    alone = {r: generate_tokens(engine, [spec(r, prompts[r], lengths[r])])[r] for r in prompts}
    got = {r: [run_row_to_join(engine, spec(r, prompts[r], lengths[r]))] for r in (1, 2, 3)}
    live, steps = {1, 2, 3}, 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps in (5, 12, 30):  # joiners mid-flight (the last into a batch shrunk to one row)
            r = {5: 4, 12: 5, 30: 6}[steps]
            got[r] = [run_row_to_join(engine, spec(r, prompts[r], lengths[r]))]
            live.add(r)
    assert got == alone


def test_a_group_prefill_and_group_join_equal_solo(gemma_dir):
    engine = engine_for(load_model(gemma_dir).model)
    rng = random.Random(3)
    specs = [spec(i, [rng.randrange(3, 500) for _ in range(6 + 9 * i)], 24) for i in range(4)]  # 6..33 tokens
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    for s in specs:
        engine.open_row(s)
    engine.prefill_group([s.row_id for s in specs])
    got: dict[int, list[int]] = {s.row_id: [] for s in specs}
    engine.join_group([s.row_id for s in specs])
    while engine.batch_size:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
    assert got == alone


def test_speculative_rows_equal_plain_decoding(gemma_dir):
    model = load_model(gemma_dir).model
    repeating = LONG[:12] * 4  # n-gram drafts to verify (and reject)
    specs = [spec(i, p, 40) for i, p in enumerate([repeating, LONG, PROMPTS[0]])]
    plain = {s.row_id: generate_tokens(engine_for(model), [s])[s.row_id] for s in specs}
    engine = engine_for(model, speculation=Speculation("ngram", 3, always=True))
    assert {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs} == plain  # solo
    assert generate_tokens(engine, specs) == plain  # a merged batch: rejected drafts are holes


# -- prompt cache --------------------------------------------------------------------------------


def test_a_hit_before_the_window_wraps_equals_a_cold_run(gemma_dir):
    model = load_model(gemma_dir).model
    first, follow = PROMPTS[0], PROMPTS[0] + [77, 300, 12, 5, 8] + LONG[:20]
    cold = generate_tokens(engine_for(model), [spec(0, follow)])[0]
    hot = engine_for(model, prompt_cache=PromptCache(1 << 30))
    run_cached(hot, first, 4)  # puts 11 positions: not wrapped
    cached, out = run_cached(hot, follow, 32)
    assert cached == len(first) and out == cold


def test_a_hit_that_would_trim_a_wrapped_cache_is_a_miss(gemma_dir):
    model = load_model(gemma_dir).model
    diverging = LONG[:30] + [1, 2, 3]
    cold = {p: generate_tokens(engine_for(model), [spec(0, p)])[0] for p in (tuple(LONG), tuple(diverging))}
    hot = engine_for(model, prompt_cache=PromptCache(1 << 30))
    assert run_cached(hot, LONG, 32) == (0, cold[tuple(LONG)])  # puts 71+ positions: wrapped
    assert run_cached(hot, diverging, 32) == (0, cold[tuple(diverging)])  # would need a trim: a miss
    # The wrapped entry still serves its exact tokens (no trim): that run's prompt extended.
    longer = LONG + cold[tuple(LONG)] + [5, 6]
    cached, out = run_cached(hot, longer, 16)
    assert cached >= 71 and out == generate_tokens(engine_for(model), [spec(0, longer, 16)])[0]


# -- a real server -------------------------------------------------------------------------------


async def test_real_server_answers_a_chat_completion(gemma_dir):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 24, "temperature": 0}
    with trio.fail_after(120):
        async with real_server(gemma_dir, batch=4) as server:
            first = await complete_whole(server, body, chat=True)
            again = await complete_whole(server, body, chat=True)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 24
    assert choice["message"]["content"] and choice["message"]["content"] == again["choices"][0]["message"]["content"]
