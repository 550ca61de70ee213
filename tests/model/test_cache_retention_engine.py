"""The engine's snapshots at a row's retention hints: each hinted prefix is put (protected, on the
cache's clock) when the prefill passes it, several in one chunk included; the boundary snapshot
still works beside them; `RowOpened.cache_created` is the longest hinted prefix stored; and a hit
after that equals a cold run."""

from __future__ import annotations

import random

import pytest

from cache.prompt_cache import PromptCache
from model.engine.engine import MIN_CACHE_TOKENS, Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.engine.snapshots import retained_length, snapshot_plan
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

CHUNK = 256


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 500) for _ in range(n))


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return load_model(qwen3_dir).model


def test_the_plan_clamps_drops_short_and_restored_positions_and_merges_duplicates():
    spec = RowSpec(1, tokens(600, 1), SamplingParams(), 4, snapshot_at=400, retain=((300, 300.0), (400, 3600.0)))
    assert snapshot_plan(spec, 0, MIN_CACHE_TOKENS) == [(300, 300.0), (400, 3600.0)]
    short = RowSpec(1, tokens(600, 1), SamplingParams(), 4, snapshot_at=500, retain=((100, 300.0), (900, 300.0)))
    assert snapshot_plan(short, 0, MIN_CACHE_TOKENS) == [(500, None), (599, 300.0)]
    assert snapshot_plan(short, 550, MIN_CACHE_TOKENS) == [(599, 300.0)]
    assert retained_length([(500, None), (599, 300.0)]) == 599 and retained_length([(500, None)]) == 0


def test_hinted_prefixes_are_put_protected_and_a_later_hit_equals_a_cold_run(model):
    now = [0.0]
    cache = PromptCache(1 << 30, now=lambda: now[0])
    hot = Engine(model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(prefill_chunk=CHUNK))
    cold = Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=CHUNK))
    system = tokens(300, 2)
    prompt = system + tokens(400, 3)
    # Two hints in the second chunk (300 and 320) and one in the third; plus the boundary at 650.
    spec = RowSpec(1, prompt, SamplingParams(), 4, snapshot_at=650, retain=((300, 300.0), (320, 60.0), (600, 3600.0)))
    opened = hot.open_row(spec)
    assert opened.cached_tokens == 0 and opened.cache_created == 600
    while hot.prefill(1).remaining:
        pass
    hot.close_row(1)
    kept = {len(t) for _, t in cache.keys()}
    assert kept == {300, 320, 600, 650}  # protected ancestors stay beside the boundary snapshot
    assert deadlines_of(cache) == {300: 300.0, 320: 60.0, 600: 3600.0, 650: None}
    # The next request shares the system prompt only: it restores those 300 tokens, which
    # refreshes the deadline of the hinted prefix they hold (and of no longer one).
    now[0] = 30.0
    other = system + tokens(20, 4) + tokens(300, 5)
    spec2 = RowSpec(2, other, SamplingParams(), 6, retain=((300, 300.0),))
    got = generate_tokens(hot, [spec2])
    assert got == generate_tokens(cold, [spec2])
    assert deadlines_of(cache)[300] == 330.0 and deadlines_of(cache)[600] == 3600.0


def deadlines_of(cache: PromptCache) -> dict[int, float | None]:
    return {len(e.ids): e.deadline for e in cache._entries.values()}


def test_a_hint_at_or_below_the_restored_prefix_creates_nothing(model):
    cache = PromptCache(1 << 30)
    hot = Engine(model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(prefill_chunk=CHUNK))
    system = tokens(300, 6)
    first = RowSpec(1, system + tokens(50, 7), SamplingParams(), 2, retain=((300, 300.0),))
    assert hot.open_row(first).cache_created == 300
    while hot.prefill(1).remaining:
        pass
    hot.close_row(1)
    second = RowSpec(2, system + tokens(50, 8), SamplingParams(), 2, retain=((300, 300.0),))
    opened = hot.open_row(second)
    assert opened.cached_tokens == 300 and opened.cache_created == 0
    hot.close_row(2)
