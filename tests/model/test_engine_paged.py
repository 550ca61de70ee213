"""`--paged-kv` on a real engine, every family (on the CPU, where a paged batch attends over its
gathered rows): rows decoding together in a paged batch give mlx-lm's greedy tokens; rows joining
and leaving mid-decode give their solo tokens; rows put to the prompt cache from a paged batch
and restored into one (a hit) give a cold run's tokens; so do rows restored from the SSD tier
after a restart. Each test also checks that the paged kind did the work (a family whose layers
all keep other kinds would pass vacuously)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from cache.prompt_cache import PromptCache
from cache.tiered import TieredPromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.engine.speculation import Speculation
from model.kv import paged
from model.kv.scheme import KVScheme
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import admit, generate_tokens
from tests.helpers.families import every_family
from tests.helpers.parity import N_TOKENS, PROMPTS, reference
from tests.helpers.ssd_store import open_store, write_item

PAGED = KVScheme(paged=True)


def shape(family: str) -> dict:
    # (Gemma 4's KV-shared layers need unshared ones first: test_cuda_defaults.py's shapes)
    return {"num_hidden_layers": 6 if family.startswith("gemma4") else 4, "head_dim": 16}


@pytest.fixture
def paged_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many positions-per-row the paged caches stored (0: the paged kind never ran)."""
    calls: list[int] = []
    real = paged.PagedBatchKVCache._write

    def spy(self, keys, values):  # type: ignore[no-untyped-def]
        calls.append(keys.shape[2])
        return real(self, keys, values)

    monkeypatch.setattr(paged.PagedBatchKVCache, "_write", spy)
    return calls


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 400) for _ in range(n))


def spec(row_id: int, prompt: Sequence[int], n: int) -> RowSpec:
    return RowSpec(row_id, tuple(prompt), SamplingParams(), n)


def staggered(
    engine: Engine, arrivals: Sequence[tuple[int, RowSpec]], *, reusable: bool = False
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Rows joining the batch after the given numbers of decode steps (each prefilled and joined
    alone), run to their ends: ({row: tokens}, {row: cached tokens at open})."""
    pending = sorted(arrivals, key=lambda a: a[0])
    out: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    live: set[int] = set()
    steps = 0
    while pending or live:
        while pending and pending[0][0] <= steps:
            _, s = pending.pop(0)
            cached[s.row_id] = admit(engine, s, out, live, reusable=reusable)
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id, reusable=reusable)
                live.discard(t.row_id)
        steps += 1
    return out, cached


def cold(model: object, specs: Sequence[RowSpec]) -> dict[int, list[int]]:
    """Each row alone on a cache-less contiguous engine."""
    engine = Engine(model, eos_token_ids=[])  # type: ignore[arg-type]
    return {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}


@pytest.mark.parametrize("family", every_family())
def test_a_paged_batch_decodes_as_mlx_lm_generates(tiny_model_factory, paged_writes, family):
    model_dir = tiny_model_factory(family, **shape(family))
    engine = Engine(load_model(model_dir).model, eos_token_ids=[], kv_scheme=PAGED)
    got = generate_tokens(engine, [spec(i, p, N_TOKENS) for i, p in enumerate(PROMPTS)])
    assert [got[i] for i in range(len(PROMPTS))] == reference(model_dir, PROMPTS)
    assert paged_writes and all(len(set(seq)) > 4 for seq in got.values())  # paged, and not degenerate


@pytest.mark.parametrize("family", every_family())
def test_paged_rows_joining_and_leaving_mid_decode_equal_their_solo_runs(tiny_model_factory, paged_writes, family):
    model = load_model(tiny_model_factory(family, **shape(family))).model
    # A row spanning two blocks, short ones that leave early, a long one joining mid-decode (its
    # blocks copied in) after others left (their blocks reused), rows crossing block ends.
    arrivals = [
        (0, spec(1, tokens(300, 1), 30)),
        (0, spec(2, tokens(20, 2), 6)),
        (3, spec(3, tokens(250, 3), 24)),
        (9, spec(4, tokens(600, 4), 12)),
        (9, spec(5, (7,), 8)),  # a one-token prompt: joins with no KV
    ]
    engine = Engine(model, eos_token_ids=[], kv_scheme=PAGED, options=EngineOptions(prefill_chunk=128))
    got, _ = staggered(engine, arrivals)
    assert got == cold(model, [s for _, s in arrivals])
    assert paged_writes and engine.live_kv_bytes() == 0


@pytest.mark.parametrize("family", every_family())
def test_paged_rows_put_and_restored_as_hits_equal_cold_runs(tiny_model_factory, paged_writes, family):
    model = load_model(tiny_model_factory(family, **shape(family))).model
    hot = Engine(model, eos_token_ids=[], kv_scheme=PAGED, prompt_cache=PromptCache(1 << 30))
    first = [spec(1, tokens(300, 11), 10), spec(2, tokens(270, 12), 14), spec(3, tokens(420, 13), 7)]
    gens, _ = staggered(hot, [(0, first[0]), (0, first[1]), (2, first[2])], reusable=True)
    writes_first = len(paged_writes)
    assert writes_first and gens == cold(model, first)  # the entries were extracted from a paged batch
    # Each conversation goes on: the next turn restores its row's entry and joins a paged batch.
    follow = [spec(10 + s.row_id, s.prompt + tuple(gens[s.row_id]) + (11, 12, 13), 9) for s in first]
    got, cached = staggered(hot, [(0, follow[0]), (0, follow[1]), (1, follow[2])])
    assert all(cached[s.row_id] >= len(s.prompt) - 4 for s in follow), cached  # hits, not cold prefills
    assert got == cold(model, follow)
    assert len(paged_writes) > writes_first


@pytest.mark.parametrize("family", every_family())
def test_paged_rows_restored_from_the_ssd_tier_equal_cold_runs(tiny_model_factory, tmp_path, paged_writes, family):
    lm = load_model(tiny_model_factory(family, **shape(family)))
    if any(c.spill_kind != "kv" for c in lm.model.make_caches()):
        pytest.skip(f"{family}: the SSD tier does not store its sliding-window or recurrent layers")
    store = open_store(tmp_path, lm)
    cache = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    engine = Engine(lm.model, eos_token_ids=[], kv_scheme=PAGED, prompt_cache=cache)
    first = [spec(1, tokens(300, 21), 8), spec(2, tokens(280, 22), 12)]
    gens, _ = staggered(engine, [(0, first[0]), (0, first[1])], reusable=True)
    assert paged_writes and len(cache.keys()) == 2 and gens == cold(lm.model, first)
    for namespace, key in cache.keys():
        item = cache.snapshot(key, namespace)
        assert item is not None and write_item(store, item)
    store.close()
    store = open_store(tmp_path, lm)  # a restart: empty RAM, the index from the scan
    cache = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    engine = Engine(lm.model, eos_token_ids=[], kv_scheme=PAGED, prompt_cache=cache)
    follow = [spec(10 + s.row_id, s.prompt + tuple(gens[s.row_id]) + (5, 6), 8) for s in first]
    got, cached = staggered(engine, [(0, follow[0]), (0, follow[1])])
    assert cache.restores == 2 and all(cached[s.row_id] >= len(s.prompt) - 3 for s in follow), cached
    assert got == cold(lm.model, follow)


def test_speculative_verification_in_a_paged_batch_takes_drafts_back_per_row(qwen3_dir, paged_writes):
    """N-gram drafts verified for a paged batch: rows keep different numbers of drafts (each row's
    own positions drop back: no holes), finish apart, and one joins mid-flight."""
    prompts = [*PROMPTS, [5, 6, 7, 8, 9] * 8]
    lengths = [N_TOKENS, 12, N_TOKENS, 25, N_TOKENS]
    drafts = Speculation("ngram", 4, ngram_min=1, always=True)
    engine = Engine(load_model(qwen3_dir).model, eos_token_ids=[], kv_scheme=PAGED, speculation=drafts)
    arrivals = [(3 if i == 4 else 0, spec(i, p, n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    got, _ = staggered(engine, arrivals)
    want = reference(qwen3_dir, prompts)
    assert got == {i: want[i][: lengths[i]] for i in range(5)}
    assert max(paged_writes) > 1  # verifications of several positions per row ran paged


def test_the_engines_live_kv_is_the_blocks_its_paged_rows_hold(qwen3_dir):
    model = load_model(qwen3_dir).model
    specs = [spec(1, tokens(700, 1), 4), spec(2, tokens(10, 2), 4)]
    held = {}
    for scheme in (PAGED, KVScheme()):
        engine = Engine(model, eos_token_ids=[], kv_scheme=scheme)
        for s in specs:
            engine.open_row(s)
            while engine.prefill(s.row_id).remaining:
                pass
            engine.join(s.row_id)
        engine.step()
        held[scheme.paged] = engine.live_kv_bytes()
        for s in specs:
            engine.close_row(s.row_id)
    per_position = 2 * len(model.layers) * 2 * 16 * 4  # keys and values, 2 KV heads of 16 dims, float32
    assert held[True] == (3 + 1) * 256 * per_position  # 701 positions in 3 blocks, 11 in 1
    assert held[False] == 2 * 768 * per_position  # both rows padded to the longest's capacity
