"""Default sampling values: request > server flag > generation_config.json > fallback."""

from __future__ import annotations

import trio

from actors.handles import sampling_defaults_for
from actors.options import options as serve_options
from actors.worker_api import ModelInfo
from model.engine.params import SamplingParams
from tests.helpers.workers import gpu_worker


def info(**generation) -> ModelInfo:
    return ModelInfo(
        name="m",
        context_length=4096,
        weights_bytes=1,
        kv_bytes_per_token=1,
        eos_token_ids=frozenset({0}),
        generation_defaults=tuple(generation.items()),
    )


def test_fallback_is_greedy():
    assert sampling_defaults_for(serve_options().sampling, info()) == SamplingParams()


def test_generation_config_applies_when_no_flag():
    got = sampling_defaults_for(serve_options().sampling, info(temperature=0.6, top_p=0.95, top_k=20))
    assert (got.temperature, got.top_p, got.top_k) == (0.6, 0.95, 20)
    assert isinstance(got.top_k, int)


def test_server_flag_beats_generation_config():
    got = sampling_defaults_for(serve_options(temperature=0.0, min_p=0.05).sampling, info(temperature=0.6, top_k=20))
    assert (got.temperature, got.top_k, got.min_p) == (0.0, 20, 0.05)


async def test_request_beats_defaults(tiny_model_factory):

    model_dir = tiny_model_factory("qwen3", generation_defaults={"temperature": 0.7, "top_p": 0.8})
    worker = gpu_worker(model_dir)
    async with trio.open_nursery() as nursery:
        loaded = await nursery.start(worker.run)
        defaults = sampling_defaults_for(serve_options().sampling, loaded)
        assert (defaults.temperature, defaults.top_p) == (0.7, 0.8)
        from api.chat import resolve_generation
        from api.fields import parse_generation

        fields = parse_generation({"temperature": 0.1}, vocab_size=None)
        gen = resolve_generation(fields, defaults=defaults, default_max_tokens=8)
        assert (gen.sampling.temperature, gen.sampling.top_p) == (0.1, 0.8)
        nursery.cancel_scope.cancel()
