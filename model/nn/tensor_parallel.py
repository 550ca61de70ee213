"""Tensor parallelism over MLX's own `mx.distributed`: split a `DecoderModel` across a group's ranks.

Megatron-style, as mlx-lm's models' `shard()` methods do: attention q/k/v and MLP gate/up are
column-parallel ("all-to-sharded": each rank computes its slice of the heads / hidden units), o
and down are row-parallel ("sharded-to-all": each rank multiplies its slice and the layer sums the
partial products with `mx.distributed.all_sum`). Embedding, norms and the LM head stay replicated,
so every rank holds the same residual stream and the same logits, and samples the same tokens.

Each rank's attention keeps only its own heads (KV heads included), so its KV cache holds
1/N of the model's KV: `model.args` is rewritten to the per-rank head counts, and
`kv_bytes_per_token` (and everything sized from it) is per rank.

Quantized linears shard too (mlx's `QuantizedAllToShardedLinear` / `QuantizedShardedToAllLinear`),
as long as each rank's slice of a row-parallel input is a whole number of quantization groups.
On CUDA they then keep MLX's op, given a batch's rows as one matrix (`quant_linear.rows_only`).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from model.nn.decoder import MLP, DecoderModel
from model.quant_linear import rows_only

COLUMN = "all-to-sharded"
ROW = "sharded-to-all"


def check_shardable(model: Any, size: int) -> None:
    """Raise ValueError, saying what does not divide, when `model` cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, not {size}")
    if not model.capabilities.sharding:
        raise ValueError(f"tensor parallelism supports the dense decoder families only, not {type(model).__name__}")
    a = model.args
    for name, value in (
        ("num_attention_heads", a.num_attention_heads),
        ("num_key_value_heads", a.num_key_value_heads),
        ("intermediate_size", a.intermediate_size),
    ):
        if value % size:
            raise ValueError(f"tensor parallel size {size} does not divide the model's {name} ({value})")
    for i, layer in enumerate(model.layers):
        if type(layer.mlp) is not MLP:
            raise ValueError(f"layer {i}: tensor parallelism does not split a mixture-of-experts MLP")
        for path, module, sharding in _linears(layer):
            if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
                raise ValueError(f"layer {i} {path}: cannot shard a {type(module).__name__}")
            if sharding == ROW and isinstance(module, nn.QuantizedLinear):
                in_dims = module.weight.shape[-1] * 32 // module.bits
                if (in_dims // size) % module.group_size:
                    raise ValueError(
                        f"layer {i} {path}: {in_dims // size} input columns per rank are not whole "
                        f"quantization groups of {module.group_size}"
                    )


def shard_model(model: DecoderModel, group: Any) -> None:
    """Split `model` in place across `group` (an `mx.distributed.Group`); size 1 leaves it whole.
    Raises ValueError (before touching anything) when the heads or the MLP do not divide."""
    size = group.size()
    check_shardable(model, size)
    if size == 1:
        return
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for path, module, sharding in _linears(layer):
            owner, name = (attn, path.split(".")[1]) if path.startswith("self_attn") else (mlp, path.split(".")[1])
            setattr(owner, name, shard_linear(module, sharding, group=group))
        attn.n_heads //= size
        attn.n_kv_heads //= size
    a = model.args
    model.args = attrs.evolve(
        a, num_attention_heads=a.num_attention_heads // size, num_key_value_heads=a.num_key_value_heads // size
    )
    rows_only(model)


def _linears(layer: Any) -> list[tuple[str, Any, str]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [
        ("self_attn.q_proj", attn.q_proj, COLUMN),
        ("self_attn.k_proj", attn.k_proj, COLUMN),
        ("self_attn.v_proj", attn.v_proj, COLUMN),
        ("self_attn.o_proj", attn.o_proj, ROW),
        ("mlp.gate_proj", mlp.gate_proj, COLUMN),
        ("mlp.up_proj", mlp.up_proj, COLUMN),
        ("mlp.down_proj", mlp.down_proj, ROW),
    ]
