"""Warm-up meets every decode batch size on throwaway rows and leaves no trace: the engine is
idle afterwards and real rows decode exactly as on an engine that never warmed up."""

from __future__ import annotations

import attrs
import pytest
import trio

from actors.gpu_worker import GpuWorker
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.kv.cache import KVCache
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens
from tests.helpers.workers import gpu_worker

SPECS = [RowSpec(i, (5 + i, 17, 42, 99, 3, 250 - i, 11, 7), SamplingParams(), 10) for i in range(1, 4)]


def test_warm_up_leaves_the_engine_idle_and_outputs_unchanged(qwen3_dir):
    loaded = load_model(qwen3_dir)
    cold = generate_tokens(Engine(loaded.model, eos_token_ids=[0, 1]), SPECS)
    warmed = Engine(load_model(qwen3_dir).model, eos_token_ids=[0, 1])
    steps_seen = []
    real_step = warmed.step
    warmed.step = lambda: steps_seen.append(warmed.batch_size) or real_step()  # type: ignore[method-assign]
    warmed.warm_up(4)
    warmed.step = real_step  # type: ignore[method-assign]
    assert warmed.active_rows == 0 and warmed.batch_size == 0
    assert sorted(set(steps_seen)) == [1, 2, 3, 4]  # every batch size was stepped
    assert warmed.eos == frozenset({0, 1})  # restored after the throwaway rows
    assert warmed.prompt_cache is None  # (this engine has none; test_warm_up_skips_the_prompt_cache)
    assert generate_tokens(warmed, SPECS) == cold


async def test_worker_warms_up_when_asked_and_counts_its_time(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[], batch=3, warm_up="on")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            assert worker.times.warm_up_s > 0
            assert await worker.run_exclusive(lambda engine: engine.active_rows) == 0
            await worker.open_row(SPECS[0])
            while (await worker.prefill(1)).remaining:
                pass
            await worker.join(1)
            await worker.step()
            await worker.close_row(1, reusable=False)
            stats = worker.times.snapshot()
            assert stats["jobs"]["step"] == 1 and stats["jobs"]["join"] == 1 and stats["busy_s"]["step"] > 0
            nursery.cancel_scope.cancel()


async def test_auto_warm_up_skips_the_cpu(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[], batch=3, warm_up="auto")
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            assert worker.times.warm_up_s == 0
            nursery.cancel_scope.cancel()


def test_warm_up_skips_the_prompt_cache(qwen3_dir):
    from cache.prompt_cache import PromptCache

    cache = PromptCache(1 << 20)
    engine = Engine(load_model(qwen3_dir).model, eos_token_ids=[], prompt_cache=cache)
    engine.warm_up(3)
    assert engine.prompt_cache is cache
    assert (cache.hits, cache.misses, cache.stats()["entries"]) == (0, 0, 0)


def test_warm_up_meets_the_bucketed_prefill_shapes(qwen3_dir):
    from tests.helpers.engine_probes import WidthRecorder

    loaded = load_model(qwen3_dir)
    cold = generate_tokens(Engine(loaded.model, eos_token_ids=[0, 1], options=EngineOptions(prefill_bucket=8)), SPECS)
    recorder = WidthRecorder(load_model(qwen3_dir).model)
    warmed = Engine(
        recorder,
        eos_token_ids=[0, 1],
        options=EngineOptions(prefill_bucket=8, group_bucket=8, prefill_chunk=64, compile_decode=False),
    )
    shapes = warmed.prefill_shapes(4)
    # one row at 8..64 (the chunk), groups of 2 and 4 rows at 8 and 16
    assert shapes == [(1, 8), (1, 16), (1, 32), (1, 64), (2, 8), (2, 16), (4, 8), (4, 16)]
    warmed.warm_up(4)
    assert set(shapes) <= set(recorder.widths)
    assert warmed.active_rows == 0 and warmed.batch_size == 0
    assert generate_tokens(warmed, SPECS) == cold
    assert Engine(loaded.model, eos_token_ids=[], options=EngineOptions(group_bucket=0)).prefill_shapes(4) == []
    assert Engine(loaded.model, eos_token_ids=[], options=EngineOptions(group_bucket=8)).prefill_shapes(2) == [
        (2, 8),
        (2, 16),
    ]


async def test_prefill_bucket_flag_reaches_the_engine(qwen3_dir):
    from actors.options import options as serve_options
    from actors.options import parse_options
    from actors.serve import _load_plan

    args = parse_options(["--prefill-bucket", "16"])
    assert args.engine.prefill_bucket == 16 and parse_options([]).engine.prefill_bucket == 0
    _, planned, _ = _load_plan(serve_options(model=str(qwen3_dir), prefill_bucket=args.engine.prefill_bucket))
    assert isinstance(planned, GpuWorker) and planned.options.engine.prefill_bucket == 16
    worker = GpuWorker(
        qwen3_dir,
        attrs.evolve(planned.options, caches=attrs.evolve(planned.options.caches, prompt_cache_gb=0)),
        eos_token_ids=[],
    )
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            buckets = await worker.run_exclusive(
                lambda engine: (engine.options.prefill_bucket, engine.options.group_bucket)
            )
            assert buckets == (16, 0)  # the group bucket is a GPU default; this is the CPU
            nursery.cancel_scope.cancel()


class Recorder:
    """The model, with a note of what `pick(tokens, caches, kwargs)` returns for each forward
    (None: nothing to note)."""

    def __init__(self, model, pick) -> None:
        self.model, self.pick, self.seen = model, pick, []

    def __call__(self, tokens, caches, **kwargs):
        if (note := self.pick(tokens, caches, kwargs)) is not None:
            self.seen.append(note)
        return self.model(tokens, caches, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_warm_up_can_meet_decode_kv_capacities(qwen3_dir):
    loaded = load_model(qwen3_dir)
    cold = generate_tokens(Engine(loaded.model, eos_token_ids=[0, 1]), SPECS)
    solo_decode = Recorder(
        load_model(qwen3_dir).model,
        lambda tokens, caches, kw: (
            (caches[0].keys.shape[2], caches[0].offset)
            if tokens.shape[1] == 1 and type(caches[0]) is KVCache and caches[0].keys is not None
            else None
        ),
    )
    # capacities 256 and 512
    warmed = Engine(
        solo_decode, eos_token_ids=[0, 1], options=EngineOptions(compile_decode=False, warm_decode_capacity=600)
    )
    warmed.warm_up(2)
    assert (256, 255) in solo_decode.seen and (512, 511) in solo_decode.seen
    assert warmed.active_rows == 0 and warmed.batch_size == 0
    assert generate_tokens(warmed, SPECS) == cold


@pytest.mark.parametrize(
    "family, shape",
    [
        ("qwen3_5", {"num_hidden_layers": 4, "head_dim": 16}),  # recurrent state layers
        ("gemma3_text", {"num_hidden_layers": 4, "head_dim": 16}),  # sliding-window layers
    ],
)
def test_decode_capacities_warm_up_on_families_whose_caches_are_not_all_kv(tiny_model_factory, family, shape):
    """The capacities' warm-up (on by default on CUDA) builds each capacity's buffers for plain
    KV layers only; a state or window layer runs on a copy of its cache, and outputs are unchanged."""
    model_dir = tiny_model_factory(family, **shape)
    cold = generate_tokens(Engine(load_model(model_dir).model, eos_token_ids=[0, 1]), SPECS)
    warmed = Engine(
        load_model(model_dir).model,
        eos_token_ids=[0, 1],
        options=EngineOptions(compile_decode=False, warm_decode_capacity=512),
    )
    warmed.warm_up(2)
    assert warmed.active_rows == 0
    assert generate_tokens(warmed, SPECS) == cold


def test_warm_up_meets_hit_prefill_widths_when_those_run_unfused(qwen3_dir, monkeypatch):
    from cache.prompt_cache import PromptCache
    from model.engine import warm_up

    monkeypatch.setattr(warm_up, "HIT_WARM_WIDTHS", (1, 5, 9))
    loaded = load_model(qwen3_dir)
    cold = generate_tokens(Engine(loaded.model, eos_token_ids=[0, 1]), SPECS)
    model = load_model(qwen3_dir).model

    def unfused(tokens, caches, kw):
        return (tokens.shape[1], caches[0].offset) if kw.get("unfused_attention") else None

    cache = PromptCache(1 << 30)
    recorder = Recorder(model, unfused)
    warmed = Engine(
        recorder,
        eos_token_ids=[0, 1],
        prompt_cache=cache,
        options=EngineOptions(compile_decode=False, unfused_hit_prefill=True),
    )
    warmed.warm_up(2)
    assert recorder.seen == [(1, 256), (5, 256), (9, 256)]  # each width once, after the 256-token prefix
    assert warmed.active_rows == 0 and len(cache) == 0  # nothing the throwaway rows made was kept
    assert generate_tokens(warmed, SPECS) == cold
    recorder = Recorder(model, unfused)
    Engine(
        recorder, eos_token_ids=[0, 1], options=EngineOptions(compile_decode=False, unfused_hit_prefill=False)
    ).warm_up(2)
    assert recorder.seen == []
