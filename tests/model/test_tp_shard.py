"""model/nn/tensor_parallel.py without a ring: what it refuses, before touching the model. (The
sharded forward itself runs on two ring processes in tests/e2e/test_tensor_parallel.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from model.load.loader import load_model
from model.nn.tensor_parallel import check_shardable, shard_model


@attrs.frozen
class _Group:  # the one thing shard_model asks of an mx.distributed.Group before sharding
    n: int

    def size(self) -> int:
        return self.n


def test_heads_that_do_not_divide_are_refused_and_the_model_is_untouched(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model: Any = load_model(tiny_model_factory("qwen3")).model  # 4 heads, 2 KV heads
    q_proj = model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads"):
        shard_model(model, _Group(3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(model, 4)
    assert model.layers[0].self_attn.q_proj is q_proj and model.args.num_attention_heads == 4


def test_a_group_of_one_leaves_the_model_whole(tiny_model_factory: Callable[..., Path]) -> None:
    model: Any = load_model(tiny_model_factory("qwen3")).model
    shard_model(model, _Group(1))
    assert model.args.num_key_value_heads == 2 and model.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4


def test_quantized_row_parallel_slices_must_be_whole_groups(tiny_model_factory: Callable[..., Path]) -> None:
    # o_proj's 64 inputs split 2 ways are 32 columns a rank: not whole groups of 64.
    model: Any = load_model(tiny_model_factory("qwen3", quant="q4", group_size=64)).model
    with pytest.raises(ValueError, match="quantization groups of 64"):
        check_shardable(model, 2)


def test_a_mixture_of_experts_model_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    model = load_model(tiny_model_factory("qwen3_moe")).model
    with pytest.raises(ValueError, match="mixture-of-experts|dense decoder"):
        check_shardable(model, 2)
