"""Every family serves under the engine defaults a CUDA GPU resolves to (model/options/engine.py:
prefill widths bucketed, decode KV capacities and unfused hit prefills warmed up, no buffer-cache
clearing), run here on the CPU: warm-up completes and greedy outputs equal an engine on the CPU's
defaults. (A Qwen3.5 model once failed start-up on CUDA alone, in the capacities' warm-up.)"""

from __future__ import annotations

import pytest

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from model.options.engine import GPU_GROUP_BUCKET
from tests.engine_helpers import generate_tokens
from tests.helpers.families import every_family

SPECS = [RowSpec(i, (5 + i, 17, 42, 99, 3, 250 - i, 11, 7) * (1 + i), SamplingParams(), 12) for i in range(1, 4)]
CUDA = EngineOptions(
    group_bucket=GPU_GROUP_BUCKET, unfused_hit_prefill=True, warm_decode_capacity=512, clear_cache=False
)


@pytest.mark.parametrize("family", every_family())
def test_each_family_warms_up_and_decodes_alike_under_cuda_defaults(tiny_model_factory, family):
    layers = 6 if family.startswith("gemma4") else 4  # (Gemma 4's KV-shared layers need unshared ones first)
    model_dir = tiny_model_factory(family, num_hidden_layers=layers, head_dim=16)
    cold = generate_tokens(Engine(load_model(model_dir).model, eos_token_ids=[0, 1]), SPECS)
    engine = Engine(load_model(model_dir).model, eos_token_ids=[0, 1], options=CUDA)
    engine.warm_up(4)
    assert engine.active_rows == 0
    assert generate_tokens(engine, SPECS) == cold
