"""Qwen2 / Qwen2.5: the Llama decoder with biased q/k/v projections."""

from __future__ import annotations

from typing import Any

from model.families import register, tie_embeddings
from model.layers import DecoderArgs


@register("qwen2")
def qwen2_args(raw: dict[str, Any], has_lm_head: bool) -> DecoderArgs:
    heads = int(raw["num_attention_heads"])
    return DecoderArgs(
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw["hidden_size"]) // heads,
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=float(raw.get("rope_theta", 1000000.0)),
        rope_traditional=bool(raw.get("rope_traditional", False)),
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 32768),
        qkv_bias=True,
        tie_word_embeddings=tie_embeddings(raw, has_lm_head, default=True),
    )
