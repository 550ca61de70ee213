"""A prefill after a prompt-cache hit runs its attention as matmuls (the CUDA default: no cuDNN
graph per new shape). The formula is MLX's own fallback, so on CPU it is bit-identical to the
fused call; a cold prompt never takes the path; a large scores matrix keeps the fused kernel."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache.prompt_cache import PromptCache
from model.engine import engine as engine_module
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.kernels import unfused_attention
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    "shape", [(1, 4, 2, 5, 17, 16), (2, 8, 8, 7, 7, 32), (1, 6, 2, 1, 9, 16), (1, 6, 3, 12, 40, 8)]
)
def test_unfused_attention_is_bit_identical_to_the_fused_call(shape, dtype):
    B, H, Hk, L, K, D = shape
    q, k, v = (
        mx.random.normal(s, key=mx.random.key(i)).astype(dtype)
        for i, s in enumerate([(B, H, L, D), (B, Hk, K, D), (B, Hk, K, D)])
    )
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    assert mx.array_equal(unfused_attention.unfused_causal_attention(q, k, v, D**-0.5), fused).item()


@pytest.fixture
def unfused_calls(monkeypatch):
    calls = []
    real = unfused_attention.unfused_causal_attention

    def counting(q, k, v, scale):
        calls.append((q.shape[2], k.shape[2]))  # (suffix width, keys)
        return real(q, k, v, scale)

    monkeypatch.setattr(unfused_attention, "unfused_causal_attention", counting)
    return calls


SYSTEM = tuple((5 * j) % 300 + 7 for j in range(200))
FIRST = RowSpec(1, SYSTEM + (11, 12, 13), SamplingParams(), 8)
SECOND = RowSpec(2, SYSTEM + (21, 22, 23, 24, 25, 26), SamplingParams(), 8)


def test_a_hit_prefills_unfused_and_decodes_like_a_cold_run(qwen3_dir, unfused_calls):
    model = load_model(qwen3_dir).model
    cold = generate_tokens(
        Engine(model, eos_token_ids=[], options=EngineOptions(unfused_hit_prefill=False)), [FIRST, SECOND]
    )
    hot = Engine(
        model, eos_token_ids=[], prompt_cache=PromptCache(1 << 30), options=EngineOptions(unfused_hit_prefill=True)
    )
    first = generate_tokens(hot, [FIRST], reusable=True)
    assert unfused_calls == []  # a cold prompt keeps the fused kernel (mlx-lm's numerics)
    opened = hot.open_row(SECOND)
    assert opened.cached_tokens > 0
    hot.close_row(SECOND.row_id)
    second = generate_tokens(hot, [SECOND])
    assert {**first, **second} == cold
    layers_per_forward = len(model.layers)
    suffix = len(SECOND.prompt) - 1 - opened.cached_tokens
    assert unfused_calls == [(suffix, len(SECOND.prompt) - 1)] * layers_per_forward


def test_a_large_scores_matrix_keeps_the_fused_kernel(qwen3_dir, unfused_calls, monkeypatch):
    monkeypatch.setattr(engine_module, "UNFUSED_SCORES_BYTES", 1024)
    model = load_model(qwen3_dir).model
    hot = Engine(
        model, eos_token_ids=[], prompt_cache=PromptCache(1 << 30), options=EngineOptions(unfused_hit_prefill=True)
    )
    generate_tokens(hot, [FIRST], reusable=True)
    assert hot.open_row(SECOND).cached_tokens > 0  # a hit, but its scores would exceed 1 KiB
    while hot.prefill(SECOND.row_id).remaining:
        pass
    hot.close_row(SECOND.row_id)
    assert unfused_calls == []
