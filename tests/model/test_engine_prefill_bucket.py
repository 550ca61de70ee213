"""Bucketed prefill: forwards right-padded to a multiple of `prefill_bucket` (opt-in) or, for
group prefill, `group_bucket` (the CUDA default), so attention graphs repeat, decode exactly like
exact-width prefill — solo, chunked, after a prompt-cache hit, across a boundary snapshot and in
groups (on CPU; on CUDA only up to cuBLAS's shape-dependent kernel choice)."""

from __future__ import annotations

import pytest

from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import decode_to_the_end, generate_tokens
from tests.helpers.engine_probes import WidthRecorder


def prompts(n: int, base: int = 11) -> list[RowSpec]:
    return [
        RowSpec(i, tuple((5 * i + 3 * j) % 200 + 4 for j in range(base + 7 * i)), SamplingParams(), 10)
        for i in range(n)
    ]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bucketed_prefill_decodes_like_exact(tiny_model_factory, family):
    loaded = load_model(tiny_model_factory(family))
    rows = prompts(4)
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[], options=EngineOptions(prefill_bucket=0)), rows)
    recorder = WidthRecorder(loaded.model)
    bucketed = Engine(recorder, eos_token_ids=[], options=EngineOptions(prefill_bucket=16, compile_decode=False))
    assert generate_tokens(bucketed, rows) == expected
    prefill_widths = {w for b, w in recorder.widths if w > 1}
    assert prefill_widths and all(w % 16 == 0 for w in prefill_widths)  # really padded


def test_bucketed_chunks_cache_hit_and_snapshot_match_exact(qwen3_dir):
    loaded = load_model(qwen3_dir)
    system = tuple((3 * j) % 190 + 6 for j in range(300))
    first = RowSpec(1, system + (9, 10, 11), SamplingParams(), 6, snapshot_at=len(system))
    second = RowSpec(2, system + (12, 13, 14, 15, 16), SamplingParams(), 6)

    def run(bucket: int) -> tuple[dict[int, list[int]], int]:
        engine = Engine(
            loaded.model,
            eos_token_ids=[],
            prompt_cache=PromptCache(1 << 30),
            options=EngineOptions(prefill_chunk=128, prefill_bucket=bucket),
        )
        out = generate_tokens(engine, [first])
        opened = engine.open_row(second)  # restores the snapshot at the boundary
        engine.close_row(second.row_id)
        return {**out, **generate_tokens(engine, [second])}, opened.cached_tokens

    exact, exact_cached = run(0)
    bucketed, bucketed_cached = run(48)  # chunks of 128 end mid-bucket: 300 = 128+128+44
    assert exact_cached == bucketed_cached == len(system)
    assert bucketed == exact


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bucketed_group_prefill_runs_one_forward_per_bucket_and_decodes_like_exact(tiny_model_factory, family):
    loaded = load_model(tiny_model_factory(family))
    # prompt[:-1] lengths 13, 18, 23, 28, 33 → buckets of 16: 16 | 32, 32, 32 | 48
    rows = [
        RowSpec(i, tuple((7 * i + 3 * j) % 200 + 4 for j in range(9 + 5 * i)), SamplingParams(), 10)
        for i in range(1, 6)
    ]
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[], options=EngineOptions(prefill_bucket=0)), rows)
    recorder = WidthRecorder(loaded.model)
    engine = Engine(recorder, eos_token_ids=[], options=EngineOptions(group_bucket=16, compile_decode=False))
    for spec in rows:
        engine.open_row(spec)
    progress = engine.prefill_group([s.row_id for s in rows])
    assert [p.remaining for p in progress] == [0] * 5
    # the three rows of bucket 32 in one forward, their count rounded up to 4 (one duplicate);
    # the lone rows of buckets 16 and 48 prefill alone, at their exact widths (prefill_bucket 0)
    assert sorted(recorder.widths) == [(1, 13), (1, 33), (4, 32)]
    out = {s.row_id: [engine.join(s.row_id).token] for s in rows}
    assert decode_to_the_end(engine, out, {s.row_id for s in rows}) == expected
