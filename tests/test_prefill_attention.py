"""The matmul prefill attention (used on CUDA instead of a per-shape cuDNN graph) computes what
MLX's fused attention computes, for every mask the engine passes, and the engine's outputs do
not change when it is forced on."""

from __future__ import annotations

import mlx.core as mx
import pytest

from actors.worker_api import RowSpec
from model import layers
from model.engine import Engine, generate_tokens
from model.kv_cache import causal_mask
from model.layers import attention_by_matmul
from model.loader import load_model
from model.params import SamplingParams


@pytest.mark.parametrize("heads,kv_heads,length,keys", [(8, 4, 7, 7), (4, 2, 5, 20), (4, 4, 3, 9), (6, 1, 16, 40)])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "array", "left_padded"])
def test_matches_fused_attention(heads, kv_heads, length, keys, mask_kind):
    batch = 2
    q = mx.random.normal((batch, heads, length, 32), key=mx.random.key(1))
    k = mx.random.normal((batch, kv_heads, keys, 32), key=mx.random.key(2))
    v = mx.random.normal((batch, kv_heads, keys, 32), key=mx.random.key(3))
    mask = {
        "causal": "causal",
        "none": None,
        "array": causal_mask(length, keys - length),
        "left_padded": causal_mask(length, keys - length, left_padding=mx.array([0, 2])),
    }[mask_kind]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    got = attention_by_matmul(q, k, v, 0.17, mask)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=1e-5).item()


def test_engine_outputs_unchanged_when_forced_on(qwen3_dir, monkeypatch):
    specs = [RowSpec(i, tuple(range(3 + i, 40 + 3 * i)), SamplingParams(), 12) for i in range(1, 4)]
    loaded = load_model(qwen3_dir)
    expected = generate_tokens(Engine(loaded.model, eos_token_ids=[]), specs)
    calls = []
    real = layers.attention_by_matmul

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setitem(layers._prefill_matmul_state, "on", True)
    monkeypatch.setattr(layers, "attention_by_matmul", counted)
    engine = Engine(loaded.model, eos_token_ids=[], prefill_chunk=16)  # chunks attend to a cache too
    assert generate_tokens(engine, specs) == expected
    assert calls and all(shape[2] > 1 for shape in calls)  # prefill only; decode keeps the kernel
