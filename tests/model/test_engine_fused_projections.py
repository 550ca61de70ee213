"""Fused decode projections (the CUDA default, model/nn/fused_projections.py) leave greedy tokens as
they were: a decode step's q/k/v and gate/up products run as one product each, prefill keeps the
separate ones (row views of the same weights)."""

from __future__ import annotations

import mlx.core as mx

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.nn.fused_projections import fuse_projections
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

SPECS = [RowSpec(i, tuple((5 * i + 3 * j) % 200 + 4 for j in range(20 + i)), SamplingParams(), 12) for i in range(3)]


def test_fused_projections_decode_like_separate_ones(tiny_model_factory):
    path = tiny_model_factory("qwen3", dtype="bfloat16")
    expected = generate_tokens(Engine(load_model(path).model, eos_token_ids=[]), SPECS)
    model = load_model(path).model
    assert fuse_projections(model)
    layer = model.layers[0]
    qkv, gate_up = layer.self_attn["_qkv"], layer.mlp["_gate_up"]
    q, k, v = (layer.self_attn[n].weight for n in ("q_proj", "k_proj", "v_proj"))
    assert qkv.shape[0] == q.shape[0] + k.shape[0] + v.shape[0]
    assert mx.array_equal(qkv[: q.shape[0]], q).item()
    assert gate_up.shape[0] == 2 * layer.mlp.gate_proj.weight.shape[0]
    assert generate_tokens(Engine(model, eos_token_ids=[]), SPECS) == expected
    eager = Engine(model, eos_token_ids=[], options=EngineOptions(compile_decode=False))
    assert generate_tokens(eager, SPECS) == expected


def test_only_half_precision_dense_layers_fuse(qwen3_dir):
    model = load_model(qwen3_dir).model  # float32
    assert not fuse_projections(model)
    assert "_qkv" not in model.layers[0].self_attn
