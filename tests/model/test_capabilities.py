"""Families declare what they can take part in (`LanguageModel.capabilities`): the engine and
tensor parallelism read the declaration, never the class. A family without the compiled decode
says so and still serves, through the plain forward."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.families.gemma3_text import Gemma3TextModel
from model.load.loader import load_model
from model.nn.tensor_parallel import check_shardable
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

PROMPT = tuple(range(3, 60))


def test_the_shared_decoder_declares_the_optional_paths(qwen3_dir):
    model = load_model(qwen3_dir).model
    capable = model.capabilities
    assert capable.compiled_decode and capable.fused_projections and capable.sharding and capable.speculation
    assert Engine(model, eos_token_ids=[])._compiled is not None


def test_a_family_without_compiled_decode_says_so_and_still_serves(tiny_model_factory):
    gemma_dir = tiny_model_factory("gemma3_text", num_hidden_layers=4, extra_config={"sliding_window": 16})
    model = load_model(gemma_dir).model
    assert isinstance(model, Gemma3TextModel)  # (the test names its fixture's family, as a test may)
    assert not model.capabilities.compiled_decode and not model.capabilities.sharding
    engine = Engine(model, eos_token_ids=[], options=EngineOptions(compile_decode=True))
    assert engine._compiled is None  # asked for, not declared: the plain forward decodes
    ours = generate_tokens(engine, [RowSpec(1, PROMPT, SamplingParams(), 24)])[1]
    reference_model, _ = mlx_lm_load_model(gemma_dir)
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), reference_model, max_tokens=24)]
    assert ours == expected
    with pytest.raises(ValueError, match="dense decoder families only"):
        check_shardable(model, 2)
