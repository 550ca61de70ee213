"""Qwen3.5-MoE (text): Qwen3.5's hybrid layers (model/families/qwen3_5.py) whose MLPs are routed
experts plus a sigmoid-gated shared expert (model/moe.py's SharedExpertMoeBlock).

As mlx-lm's qwen3_5 (the oracle) every layer is sparse once `num_experts` > 0. Checkpoints come as
Hugging Face's fused `experts.gate_up_proj` / `experts.down_proj`, per-expert tensors, or
mlx-community's stacked (and quantized) `switch_mlp`; sanitize makes them all the stacked one.
`HybridMoeModel` is Qwen3-Next's model too (model/families/qwen3_next.py).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from model.families.qwen3_5 import HybridArgs, Qwen35Model, hybrid_args
from model.families.qwen3_moe import MoeArgs
from model.load.errors import ModelLoadError
from model.moe import SharedExpertMoeBlock, expert_prefixes, stack_experts, unfuse_experts
from model.nn.decoder import MLP

MODEL_TYPES: tuple[str, ...] = ("qwen3_5_moe",)


class HybridMoeModel(Qwen35Model):
    """The hybrid model with a `SharedExpertMoeBlock` as the MLP of each layer `moe.sparse` names."""

    def __init__(self, args: HybridArgs, moe: MoeArgs, shared_intermediate_size: int) -> None:
        super().__init__(args)
        self.moe = moe
        shared_args = attrs.evolve(args.base, intermediate_size=shared_intermediate_size)
        for i, layer in enumerate(self.layers):
            # Set by key (HybridLayer types `mlp` as the dense MLP it built, never evaluated).
            if moe.sparse(i):
                layer["mlp"] = SharedExpertMoeBlock(
                    args.base.hidden_size,
                    moe.moe_intermediate_size,
                    moe.num_experts,
                    moe.num_experts_per_tok,
                    moe.norm_topk_prob,
                    MLP(shared_args),
                )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        try:
            unfuse_experts(weights)
            for prefix in expert_prefixes(weights):
                stack_experts(weights, prefix, self.moe.num_experts)
        except KeyError as e:
            raise ModelLoadError(f"expert weights incomplete: {e.args[0]}") from None
        return weights


def moe_args(text: dict[str, Any], *, norm_topk_default: bool, honour_sparse_step: bool) -> MoeArgs:
    """The routed experts' shape; mlx-lm's qwen3_5 makes every layer sparse, Qwen3-Next follows
    `decoder_sparse_step` and `mlp_only_layers` (Qwen3-MoE's rule)."""
    step = int(text.get("decoder_sparse_step") or 1) if honour_sparse_step else 1
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return MoeArgs(
        num_experts=int(text["num_experts"]),
        num_experts_per_tok=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=bool(text.get("norm_topk_prob", norm_topk_default)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()) if honour_sparse_step else (),
    )


def build(config: dict[str, Any], has_lm_head: bool) -> HybridMoeModel:
    text = config.get("text_config") or config  # a vision-language checkpoint nests the text model
    moe = moe_args(text, norm_topk_default=True, honour_sparse_step=False)  # (mlx-lm's TextModelArgs default)
    # Every layer is sparse: the dense MLP's width (often absent from the config) is never used.
    text = {**text, "intermediate_size": text.get("intermediate_size") or moe.moe_intermediate_size}
    args = hybrid_args(text, has_lm_head)
    return HybridMoeModel(args, moe, int(text["shared_expert_intermediate_size"]))
