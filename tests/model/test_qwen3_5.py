"""Qwen3.5 (gated-delta linear attention beside full attention): greedy tokens equal mlx-lm's;
batched and group-prefilled rows equal a solo run; a prompt-cache entry serves only a prompt
that extends exactly what it covers (a state cannot be trimmed back), anything else is a miss
with the cold output."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.families.qwen3_5 import linear_layers
from model.kv.cache import BatchKVCache, KVCache
from model.kv.state import BatchStateCache, StateCache
from model.load.loader import load_model
from model.nn.gated_delta import GatedDeltaNet
from tests.engine_helpers import decode_to_the_end, generate_tokens
from tests.helpers.hybrid import cold, engine_for, run, run_row_to_join, spec
from tests.helpers.parity import PROMPTS, ours, reference

SHAPE = {"num_hidden_layers": 4, "head_dim": 16}  # linear, full, linear, full


@pytest.fixture(scope="module")
def hybrid_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_5", **SHAPE)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_model(hybrid_dir).model


@pytest.fixture(scope="module", params=[None, "q4"], ids=["fp32", "q4"])
def any_hybrid(request, tiny_model_factory):
    """The float model, and the q4 one in mlx-community's layout (sanitized, language_model.* keys)."""
    return load_model(tiny_model_factory("qwen3_5", quant=request.param, **SHAPE)).model


@pytest.mark.parametrize("quant", [None, "q4"], ids=["fp32", "q4"])
def test_greedy_matches_mlx_lm(tiny_model_factory, quant):
    model_dir = tiny_model_factory("qwen3_5", quant=quant, **SHAPE)
    got, want = ours(model_dir, PROMPTS), reference(model_dir, PROMPTS)
    assert got == want
    assert all(len(set(seq)) > 4 for seq in got)  # not a degenerate repeat: the check can fail


def test_chunked_prefill_carries_the_state(hybrid_dir):
    long_prompt = [[(i * 13) % 450 + 3 for i in range(150)]]
    assert ours(hybrid_dir, long_prompt, prefill_chunk=32) == reference(hybrid_dir, long_prompt, prefill_chunk=32)


def test_layer_kinds_and_caches_follow_the_config(hybrid):
    assert [layer.is_linear for layer in hybrid.layers] == [True, False, True, False]
    assert isinstance(hybrid.layers[0].linear_attn, GatedDeltaNet)
    caches = hybrid.make_caches()
    assert [type(c) for c in caches] == [StateCache, KVCache, StateCache, KVCache]
    assert not caches[0].is_trimmable() and caches[0].trim(3) == 0
    assert linear_layers({"layer_types": ["full_attention", "linear_attention"]}, 2) == (False, True)
    assert linear_layers({"full_attention_interval": 4}, 4) == (True, True, True, False)
    with pytest.raises(ValueError):
        linear_layers({"layer_types": ["linear_attention"]}, 2)


# -- batching --------------------------------------------------------------------------------


def test_batch_with_a_join_and_a_leave_equals_solo(any_hybrid):
    engine = engine_for(any_hybrid, prefill_chunk=16)
    prompts = {1: PROMPTS[0], 2: PROMPTS[1], 3: PROMPTS[2], 4: [9] * 5 + [123, 456, 78], 5: [31], 6: [41, 59, 26]}
    lengths = {r: 10 if r == 2 else 24 for r in prompts}
    alone = {r: generate_tokens(engine, [spec(r, prompts[r], lengths[r])])[r] for r in prompts}
    got = {r: [run_row_to_join(engine, spec(r, prompts[r], lengths[r]))] for r in (1, 2, 3, 4)}
    assert isinstance(engine._caches[0], BatchStateCache) and isinstance(engine._caches[1], BatchKVCache)
    live, steps = {1, 2, 3, 4}, 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps == 5:  # joiners mid-flight, one of a single token (no state yet); row 2 leaves early
            got[5] = [run_row_to_join(engine, spec(5, prompts[5], lengths[5]))]
            got[6] = [run_row_to_join(engine, spec(6, prompts[6], lengths[6]))]
            live |= {5, 6}
    assert got == alone


def test_group_prefill_of_unequal_rows_equals_solo(hybrid):
    # One right-padded forward: each row's state is recomputed over its own tokens, never the padding.
    engine = engine_for(hybrid)
    rng = random.Random(3)
    specs = [spec(i, [rng.randrange(3, 500) for _ in range(4 + 5 * i)], 12) for i in range(4)]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    for s in specs:
        engine.open_row(s)
    engine.prefill_group([s.row_id for s in specs])
    assert engine.join_group([s.row_id for s in specs]) == [None] * 4
    got = decode_to_the_end(engine, {s.row_id: [] for s in specs}, {s.row_id for s in specs})
    assert got == alone


# -- prompt cache ------------------------------------------------------------------------------


def test_a_hit_at_the_covered_boundary_equals_a_cold_run(any_hybrid):
    hybrid = any_hybrid
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    cache = PromptCache(1 << 30)
    hot = engine_for(hybrid, cache, prefill_chunk=64)
    cached, first = run(hot, spec(0, prompt, 12))
    assert cached == 0 and first == cold(hybrid, prompt)
    [(_, covered)] = cache.keys()  # the closed row's tokens its state covers
    assert list(covered) == (prompt + first)[: len(covered)] and len(covered) > len(prompt)
    # The next turn extends exactly what the closed row covered.
    turn = list(covered) + [rng.randrange(3, 500) for _ in range(20)]
    cached, second = run(hot, spec(0, turn, 12))
    assert cached == len(covered)
    assert second == cold(hybrid, turn)


def test_a_prefix_inside_an_entry_is_a_miss_with_the_cold_output(hybrid):
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    follow = prompt[:200] + [rng.randrange(3, 500) for _ in range(37)]  # the entry would need trimming
    hot = engine_for(hybrid, PromptCache(1 << 30), prefill_chunk=64)
    run(hot, spec(0, prompt, 12))
    cached, out = run(hot, spec(0, follow, 12))
    assert cached == 0 and out == cold(hybrid, follow)


def test_snapshots_are_taken_only_where_a_chunk_ends(hybrid):
    # A snapshot inside a chunk would need the state trimmed back: none is put (a miss, never
    # wrong); at a chunk's end it is exact and serves the next prompt sharing that prefix.
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(400)]
    for at, hit in ((300, False), (320, True)):
        hot = engine_for(hybrid, PromptCache(1 << 30), prefill_chunk=64)
        run(hot, spec(0, prompt, 4, snapshot_at=at), reusable=False)
        follow = prompt[:at] + [rng.randrange(3, 500) for _ in range(30)]
        cached, out = run(hot, spec(0, follow, 12), reusable=False)
        assert cached == (at if hit else 0)
        assert out == cold(hybrid, follow)


def test_state_cache_row_cannot_cut_back_without_its_input():
    cache = StateCache()
    cache.update(mx.zeros((2, 3, 8)), mx.zeros((2, 1, 4, 4)), 5)
    assert cache.row(1, 5).offset == 5
    with pytest.raises(ValueError):
        cache.row(1, 4)


def test_speculation_is_off_for_recurrent_state_layers(hybrid):
    """A state cannot take rejected drafts back: an engine asked to speculate decodes plainly,
    with the same tokens."""
    from model.engine.speculation import Speculation

    engine = Engine(hybrid, eos_token_ids=[], speculation=Speculation("ngram", 3, always=True))
    assert engine.speculator is None
    spec = RowSpec(0, tuple(PROMPTS[0]), SamplingParams(), 16)
    assert generate_tokens(engine, [spec]) == generate_tokens(Engine(hybrid, eos_token_ids=[]), [spec])


async def test_real_server_serves_the_hybrid_model_concurrently_with_the_cache_on(hybrid_dir):
    """The whole stack on recurrent-state layers: warm-up, concurrent rows batched together, and a
    repeated request with the prompt cache on (its entries are exact-boundary only) answering the same."""
    import trio

    from tests.realserver import complete_whole, real_server

    def body(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 10, "temperature": 0}

    with trio.fail_after(120):
        async with real_server(hybrid_dir, batch=4, prompt_cache_bytes=1 << 30) as server:
            alone = [await complete_whole(server, body(t), chat=True) for t in ("sea", "mountain range")]
            together: list = [None, None]

            async def one(i: int, text: str) -> None:
                together[i] = await complete_whole(server, body(text), chat=True)

            async with trio.open_nursery() as nursery:
                for i, text in enumerate(("sea", "mountain range")):
                    nursery.start_soon(one, i, text)
            again = await complete_whole(server, body("sea"), chat=True)
    texts = [r["choices"][0]["message"]["content"] for r in alone]
    assert texts[0] and [r["choices"][0]["message"]["content"] for r in together] == texts
    assert again["choices"][0]["message"]["content"] == texts[0]
