"""The engine with a prompt cache: a hit never changes greedy output, only the work done.

Every hit result is compared with a cold run of the same prompt on a cache-less engine sharing
the model, with the attention after a hit fused and unfused. Prompts are >= 300 tokens with
prefill_chunk=64, so restored prefixes, chunk splits and snapshots land mid-chunk.
"""

from __future__ import annotations

import random
import sys

import pytest

from cache.boundary import stable_prefix_length
from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from model.text.tokenizer import Tokenizer
from tests.engine_helpers import generate_tokens

CHUNK = 64
N_TOKENS = 12
GREEDY = SamplingParams()


def rand_tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


P = rand_tokens(400, 1)


UNFUSED_HIT = False  # the engines' unfused_hit_prefill, set per test by `hit_attention`


@pytest.fixture(autouse=True, params=[False, True], ids=["fused", "unfused-hit"])
def hit_attention(request, monkeypatch):
    # every test twice: a prefill after a hit with the fused attention kernel, and as matmuls
    # (the CUDA default, test_engine_unfused_hit.py)
    monkeypatch.setattr(sys.modules[__name__], "UNFUSED_HIT", request.param)


def options(chunk=CHUNK, **kw):
    return EngineOptions(prefill_chunk=chunk, unfused_hit_prefill=UNFUSED_HIT, **kw)


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return load_model(qwen3_dir).model


@pytest.fixture(scope="module")
def cold(model):
    return Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=CHUNK))


def hot_engine(model, max_bytes=1 << 30):
    return Engine(model, eos_token_ids=[], prompt_cache=PromptCache(max_bytes), options=options())


def spec(row_id, prompt, max_tokens=N_TOKENS, **kw):
    return RowSpec(row_id, tuple(prompt), GREEDY, max_tokens, **kw)


def open_and_prefill(engine, s):
    """open_row + prefill to the end; (RowOpened, [done after each chunk])."""
    opened = engine.open_row(s)
    dones = []
    while True:
        progress = engine.prefill(s.row_id)
        dones.append(progress.done)
        if not progress.remaining:
            return opened, dones


def run_solo(engine, prompt, *, reusable=True, row_id=0, **kw):
    """Generate one row alone; (generated tokens, cached_tokens)."""
    opened, _ = open_and_prefill(engine, spec(row_id, prompt, **kw))
    out = [engine.join(row_id)]
    while not out[-1].finish:
        out += engine.step()
    engine.close_row(row_id, reusable=reusable)
    return [t.token for t in out], opened.cached_tokens


def cold_run(cold, prompt, max_tokens=N_TOKENS):
    return generate_tokens(cold, [spec(0, prompt, max_tokens)])[0]


# -- solo rows ------------------------------------------------------------------------------------


def test_exact_repeat_hits_and_matches_cold(model, cold):
    hot = hot_engine(model)
    first, cached0 = run_solo(hot, P)
    again, cached1 = run_solo(hot, P)
    assert cached0 == 0 and cached1 == len(P) - 1
    assert first == again == cold_run(cold, P)
    assert hot.prompt_cache.stats()["hits"] == 1


def test_shared_prefix_hits_and_matches_cold(model, cold):
    hot = hot_engine(model)
    run_solo(hot, P)
    other = P[:300] + rand_tokens(80, 2)
    got, cached = run_solo(hot, other)
    assert cached == 300  # rand_tokens(80, 2)[0] != P[300]
    assert got == cold_run(cold, other)


def test_prompt_inside_a_longer_entry_trims_it_and_matches_cold(model, cold):
    hot = hot_engine(model)
    run_solo(hot, P)
    shorter = P[:333]
    got, cached = run_solo(hot, shorter)
    assert cached == 332
    assert got == cold_run(cold, shorter)


def test_put_key_is_prompt_plus_every_fed_token(model, cold):
    hot = hot_engine(model)
    gen, _ = run_solo(hot, P)
    # Every generated token was fed (the pipeline computed one step ahead), so the entry covers
    # the whole reply; continuing the conversation from it must match a cold run exactly.
    assert hot.prompt_cache.find_exact(P + gen) is not None
    follow = P + gen + rand_tokens(40, 3)
    got, cached = run_solo(hot, follow)
    assert cached == len(P) + len(gen)
    assert got == cold_run(cold, follow)


def test_row_finishing_at_token_zero_puts_the_prompt(model):
    hot = hot_engine(model)
    gen, _ = run_solo(hot, P, max_tokens=1)
    assert len(gen) == 1
    assert hot.prompt_cache.find_exact(P) is not None  # the join fed the last prompt token only


def test_not_reusable_never_puts(model):
    hot = hot_engine(model)
    run_solo(hot, P, reusable=False)
    assert hot.prompt_cache.stats()["entries"] == 0
    opened, _ = open_and_prefill(hot, spec(0, P))
    hot.close_row(0, reusable=False)  # an abort mid-prefill
    assert hot.prompt_cache.stats()["entries"] == 0


def test_row_closed_mid_prefill_puts_what_it_covers(model, cold):
    hot = hot_engine(model)
    hot.open_row(spec(0, P))
    hot.prefill(0)
    hot.prefill(0)
    hot.close_row(0, reusable=True)
    assert hot.prompt_cache.find_exact(P[: 2 * CHUNK]) is not None
    got, cached = run_solo(hot, P)
    assert cached == 2 * CHUNK and got == cold_run(cold, P)


def test_disabled_cache_never_hits(model, cold):
    hot = hot_engine(model, max_bytes=0)
    run_solo(hot, P)
    got, cached = run_solo(hot, P)
    assert cached == 0 and got == cold_run(cold, P)


# -- boundary snapshots ---------------------------------------------------------------------------


def test_snapshot_stores_exactly_that_prefix_without_splitting_prefill(model, cold):
    hot = hot_engine(model)
    opened, dones = open_and_prefill(hot, spec(0, P, snapshot_at=300))
    hot.close_row(0, reusable=False)  # only the snapshot survives
    assert 300 not in dones and 300 % CHUNK != 0  # no extra forward ends at the boundary
    assert hot.prompt_cache.stats()["entries"] == 1
    assert hot.prompt_cache.find_exact(P[:300]) is not None
    nxt = P[:300] + rand_tokens(60, 4)
    got, cached = run_solo(hot, nxt)
    assert cached == 300 and got == cold_run(cold, nxt)


def test_snapshot_does_not_disturb_the_row_that_takes_it(model, cold):
    hot = hot_engine(model)
    got, _ = run_solo(hot, P, snapshot_at=300)
    assert got == cold_run(cold, P)


def test_group_prefilled_rows_take_their_snapshots(model, cold):
    # Chat rows carry a boundary snapshot; the group forward takes them like a solo prefill
    # (before, such rows were left out of the group and prefilled alone afterwards).
    hot = Engine(model, eos_token_ids=[], prompt_cache=PromptCache(1 << 30), options=options(512, group_bucket=0))
    a, b = P[:300] + rand_tokens(30, 5), rand_tokens(350, 6)
    hot.open_row(spec(1, a, snapshot_at=300))
    hot.open_row(spec(2, b, snapshot_at=349))  # the boundary at the very end of prompt[:-1]
    assert hot.groupable(1) and hot.groupable(2)
    assert [p.remaining for p in hot.prefill_group([1, 2])] == [0, 0]
    hot.close_row(1, reusable=False)
    hot.close_row(2, reusable=False)  # only the snapshots survive
    assert hot.prompt_cache.stats()["entries"] == 2
    assert hot.prompt_cache.find_exact(a[:300]) is not None and hot.prompt_cache.find_exact(b[:349]) is not None
    for prefix, seed in ((a[:300], 7), (b[:349], 8)):
        nxt = prefix + rand_tokens(60, seed)
        got, cached = run_solo(hot, nxt)
        assert cached == len(prefix) and got == cold_run(cold, nxt)


@pytest.mark.parametrize("at", [255, 100])
def test_no_snapshot_below_256_tokens(model, at):
    hot = hot_engine(model)
    open_and_prefill(hot, spec(0, P, snapshot_at=at))
    hot.close_row(0, reusable=False)
    assert hot.prompt_cache.stats()["entries"] == 0


def test_no_snapshot_inside_the_cached_prefix(model):
    hot = hot_engine(model)
    run_solo(hot, P)
    entries_before = hot.prompt_cache.stats()["entries"]
    opened, _ = open_and_prefill(hot, spec(0, P[:350] + [7] * 20, snapshot_at=300))
    hot.close_row(0, reusable=False)
    assert opened.cached_tokens == 350
    assert hot.prompt_cache.find_exact(P[:300]) is None
    assert hot.prompt_cache.stats()["entries"] == entries_before


# -- batches --------------------------------------------------------------------------------------


def batch_prompts():
    shared = P[:320]
    return {
        1: P,  # exact repeat of the seeded entry
        2: shared + rand_tokens(40, 5),  # shared prefix
        3: P[:350],  # inside the longer entry: trimmed
        4: rand_tokens(310, 6),  # a miss
    }


def test_batch_with_hits_matches_the_cold_batch(model, cold):
    prompts = batch_prompts()
    hot = hot_engine(model)
    run_solo(hot, P)
    specs = [spec(r, p) for r, p in prompts.items()]
    opened = {}
    for s in specs:  # mirror generate_tokens, recording cached_tokens
        opened[s.row_id] = hot.open_row(s).cached_tokens
        hot.close_row(s.row_id)
    assert opened == {1: 399, 2: 320, 3: 349, 4: 0}
    got = generate_tokens(hot, specs, reusable=True)
    assert got == generate_tokens(cold, specs)


def test_merged_rows_are_extracted_and_put(model, cold):
    prompts = batch_prompts()
    hot = hot_engine(model)
    specs = [spec(r, p) for r, p in prompts.items()]
    gens = generate_tokens(hot, specs, reusable=True)
    pc = hot.prompt_cache
    for r in prompts:
        assert pc.find_exact(prompts[r] + gens[r]) is not None, r
    for r in prompts:  # each extracted entry continues the conversation exactly
        follow = prompts[r] + gens[r] + [11, 12, 13]
        got, cached = run_solo(hot, follow, row_id=10 + r)
        assert cached == len(prompts[r]) + len(gens[r])
        assert got == cold_run(cold, follow)


def test_finished_row_that_kept_stepping_is_not_put(model):
    hot = hot_engine(model)
    a, b = spec(1, P, max_tokens=3), spec(2, rand_tokens(300, 7), max_tokens=30)
    for s in (a, b):
        open_and_prefill(hot, s)
        hot.join(s.row_id)
    done = False
    while not done:
        done = any(t.row_id == 1 and t.finish for t in hot.step())
    hot.step()  # fed a token row 1 never reported: its KV is now longer than what it knows
    hot.close_row(1, reusable=True)
    assert hot.prompt_cache.stats()["entries"] == 0
    hot.close_row(2)


# -- eviction -------------------------------------------------------------------------------------


def test_eviction_keeps_bytes_under_the_cap(model):
    per_token = model.kv_bytes_per_token(4)  # float32 KV
    cap = 700 * per_token  # a bit less than two entries of ~400 tokens
    hot = hot_engine(model, max_bytes=cap)
    for seed in range(5):
        run_solo(hot, rand_tokens(380, 100 + seed))
        stats = hot.prompt_cache.stats()
        assert 0 < stats["bytes"] <= cap and stats["entries"] == 1
    hot_small = hot_engine(model, max_bytes=100 * per_token)  # no entry fits
    run_solo(hot_small, P)
    assert hot_small.prompt_cache.stats()["entries"] == 0


def test_a_hit_whose_donor_is_evicted_while_live_stays_correct(model, cold):
    per_token = model.kv_bytes_per_token(4)
    hot = hot_engine(model, max_bytes=700 * per_token)  # one (512-slot buffer) entry at a time
    run_solo(hot, P)
    mine = P[:300] + rand_tokens(50, 8)
    opened = hot.open_row(spec(0, mine))  # holds clones of P's entry
    assert opened.cached_tokens == 300
    run_solo(hot, rand_tokens(380, 9), row_id=1)  # evicts the donor meanwhile
    assert hot.prompt_cache.find_exact(P + cold_run(cold, P)) is None
    while hot.prefill(0).remaining:
        pass
    out = [hot.join(0)]
    while not out[-1].finish:
        out += hot.step()
    hot.close_row(0, reusable=True)
    assert [t.token for t in out] == cold_run(cold, mine)


# -- an agent's conversation ----------------------------------------------------------------------


@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}], ids=["plain", "thinking-off"])
def test_ten_turn_chat_hits_every_turn_from_the_second(qwen3_dir, model, cold, template_kwargs):
    tok = Tokenizer.from_dir(qwen3_dir)
    hot = hot_engine(model)
    # The bound: turn t restores at least turn t-1's whole prompt except the generation-prompt
    # tail that a reply in history does not keep. With plain chatml that tail is empty (history
    # renders "<|im_start|>assistant\n" exactly like the generation prompt); with thinking off the
    # generation prompt also writes an empty think block that history drops.
    tail = 0
    if template_kwargs.get("enable_thinking") is False:
        tail = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    messages = [{"role": "system", "content": "You are a careful assistant. " * 30}]
    prev_len = None
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {3 * turn}?"})
        prompt = tok.encode_chat(messages, **template_kwargs)
        stable = stable_prefix_length(tok, messages, prompt_tokens=prompt, **template_kwargs)
        assert stable == len(prompt) - tail
        got, cached = run_solo(hot, prompt, row_id=turn, snapshot_at=stable)
        assert got == cold_run(cold, prompt)
        if prev_len is None:
            assert len(prompt) >= 300 and cached == 0
        else:
            assert cached >= prev_len - tail, (turn, cached, prev_len)
        prev_len = len(prompt)
        messages.append({"role": "assistant", "content": tok.decode(got, skip_special_tokens=True)})
    assert hot.prompt_cache.stats()["hits"] == 9


def test_a_failing_put_still_lets_the_row_leave_cleanly(model, cold):
    class Broken(PromptCache):
        def put(self, tokens, caches, namespace=""):
            raise RuntimeError("boom")

    engine = Engine(model, eos_token_ids=[], prompt_cache=Broken(1 << 30), options=options())
    specs = [spec(1, P, max_tokens=4), spec(2, rand_tokens(320, 10), max_tokens=N_TOKENS)]
    assert generate_tokens(engine, specs, reusable=True) == generate_tokens(cold, specs)
    assert engine.active_rows == 0 and engine.batch_size == 0
