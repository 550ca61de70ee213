"""Qwen3-MoE: the Qwen3 decoder whose MLPs are routed experts (model/moe.py) where the config says.

A layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of
`decoder_sparse_step` (mlx-lm's and Hugging Face's rule); the others keep the dense SwiGLU MLP of
`intermediate_size`. Attention and the KV cache are Qwen3's, unchanged.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from model.families.qwen3 import decoder_args
from model.load.errors import ModelLoadError
from model.moe import SparseMoeBlock, expert_prefixes, stack_experts
from model.nn.decoder import DecoderArgs, DecoderModel

MODEL_TYPES: tuple[str, ...] = ("qwen3_moe",)


@attrs.frozen
class MoeArgs:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )


class Qwen3MoeModel(DecoderModel):
    """The shared decoder with `SparseMoeBlock` as the MLP of its sparse layers."""

    def __init__(self, args: DecoderArgs, moe: MoeArgs) -> None:
        super().__init__(args)
        self.moe = moe
        for i, layer in enumerate(self.layers):
            # Set as the layer's child by key (DecoderLayer types `mlp` as its dense MLP); the
            # dense one it replaces was never evaluated, so it cost no memory.
            if moe.sparse(i):
                layer["mlp"] = SparseMoeBlock(
                    args.hidden_size,
                    moe.moe_intermediate_size,
                    moe.num_experts,
                    moe.num_experts_per_tok,
                    moe.norm_topk_prob,
                )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for prefix in expert_prefixes(weights):
            try:
                stack_experts(weights, prefix, self.moe.num_experts)
            except KeyError as e:
                raise ModelLoadError(f"expert weights incomplete: {e.args[0]}") from None
        return weights


def build(config: dict[str, Any], has_lm_head: bool) -> Qwen3MoeModel:
    step = int(config.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    moe = MoeArgs(
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        # Hugging Face's Qwen3MoeConfig default; released checkpoints set it true.
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
    )
    args = decoder_args(config, has_lm_head)  # attention and dense layers are Qwen3's
    return Qwen3MoeModel(args, moe)
