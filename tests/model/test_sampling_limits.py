"""Sampling at temperatures so small that 1/T overflows: the limit of sampling is the argmax of
the (masked, filtered) distribution, never an arbitrary token — a grammar's mask must hold."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.engine.params import SamplingParams
from model.engine.sampling import RowSampler


@pytest.mark.parametrize("temperature", [3.2e-296, 1e-40, 1e-300])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_vanishing_temperature_samples_the_allowed_argmax(temperature, dtype):
    # A grammar-style mask: only tokens 5 and 7 allowed, both unlikely.
    logits = mx.full((1, 16), -mx.inf)
    logits[0, 5] = -30.0
    logits[0, 7] = -20.0
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
    for top_p in (1.0, 0.5):
        sampler = RowSampler(SamplingParams(temperature=temperature, top_p=top_p, seed=3))
        assert [sampler.sample(logprobs, step).item() for step in range(8)] == [7] * 8


def test_an_ordinary_temperature_still_samples():
    logprobs = mx.log(mx.softmax(mx.array([[0.0, 0.1, 0.2, 0.0]])))
    sampler = RowSampler(SamplingParams(temperature=1.0, seed=5))
    assert len({sampler.sample(logprobs, step).item() for step in range(64)}) > 1
