"""Greedy parity against mlx-lm: our engine's tokens and mlx-lm's `generate_step` on the same
weights and prompts (the model tests of every family share these)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 11, 7],
    [300, 2, 77],
    list(range(40, 140, 3)),
    # Longer than model.cpu_attention.BLOCK: on CPU, float32 prefill attention runs in blocks.
    [(i * 37) % 400 + 3 for i in range(200)],
]
N_TOKENS = 32


def ours(
    model_dir: Any, prompts: Any, *, prefill_chunk: int = 2048, sampling: SamplingParams = SamplingParams()
) -> list[list[int]]:
    engine = Engine(load_model(model_dir).model, eos_token_ids=[], options=EngineOptions(prefill_chunk=prefill_chunk))
    results = []
    for i, prompt in enumerate(prompts):
        results.append(generate_tokens(engine, [RowSpec(i, tuple(prompt), sampling, N_TOKENS)])[i])
    return results


def reference(model_dir: Any, prompts: Any, *, prefill_chunk: int = 2048, **kw: Any) -> list[list[int]]:
    model, _ = mlx_lm_load_model(model_dir)
    return [
        [
            int(tok)
            for tok, _ in generate_step(mx.array(p), model, max_tokens=N_TOKENS, prefill_step_size=prefill_chunk, **kw)
        ]
        for p in prompts
    ]
