"""Qwen3-Next: Qwen3.5-MoE's model (model/families/qwen3_5_moe.py) with mlx-lm's qwen3_next
differences: the gated delta net's input projections are fused (q/k/v/z in one, b/a in another,
grouped per key head), sparse layers follow `decoder_sparse_step` / `mlp_only_layers` (the others
keep the dense MLP), attention is always output-gated, and RoPE is read from the top-level
`rope_theta` / `partial_rotary_factor` / `rope_scaling`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model.families.qwen3_5 import HybridArgs, hybrid_args
from model.families.qwen3_5_moe import HybridMoeModel, moe_args
from model.families.qwen3_moe import MoeArgs
from model.nn.gated_delta import GatedDeltaNet

MODEL_TYPES: tuple[str, ...] = ("qwen3_next",)


class FusedGatedDeltaNet(GatedDeltaNet):
    """The gated delta net with Qwen3-Next's two input projections; mlx-lm's
    fix_query_key_value_ordering recovers Qwen3.5's four from them."""

    def make_projections(self) -> None:
        a = self.args
        self.in_proj_qkvz = nn.Linear(a.hidden_size, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(a.hidden_size, 2 * a.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        a = self.args
        B, S, _ = x.shape
        nk, dk, nv, dv = a.num_k_heads, a.head_k_dim, a.num_v_heads, a.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(B, S, nk, -1)  # per key head: q, k, then its v and z heads
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + nv // nk * dv], axis=-1)
        b, a_ = mx.split(self.in_proj_ba(x).reshape(B, S, nk, -1), [nv // nk], axis=-1)
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z.reshape(B, S, nv, dv), b.reshape(B, S, nv), a_.reshape(B, S, nv)


class Qwen3NextModel(HybridMoeModel):
    def __init__(self, args: HybridArgs, moe: MoeArgs, shared_intermediate_size: int) -> None:
        super().__init__(args, moe, shared_intermediate_size)
        for layer in self.layers:
            if layer.is_linear:  # (the net HybridLayer built was never evaluated)
                layer["linear_attn"] = FusedGatedDeltaNet(args.delta)


def build(config: dict[str, Any], has_lm_head: bool) -> Qwen3NextModel:
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    rope.update({k: config[k] for k in ("rope_theta", "partial_rotary_factor") if k in config})
    text = {**config, "rope_parameters": rope, "attn_output_gate": True}
    moe = moe_args(config, norm_topk_default=False, honour_sparse_step=True)  # (mlx-lm's ModelArgs default)
    return Qwen3NextModel(hybrid_args(text, has_lm_head), moe, int(config["shared_expert_intermediate_size"]))
