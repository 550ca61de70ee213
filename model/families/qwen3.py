"""Qwen3 (dense): explicit head_dim, no q/k/v bias, RMSNorm on q and k per head before RoPE."""

from __future__ import annotations

from typing import Any

from model.families.common import head_dim_of, tie_embeddings
from model.nn.decoder import DecoderArgs, DecoderModel

MODEL_TYPES: tuple[str, ...] = ("qwen3",)


def build(config: dict[str, Any], has_lm_head: bool) -> DecoderModel:
    return DecoderModel(decoder_args(config, has_lm_head))


def decoder_args(config: dict[str, Any], has_lm_head: bool) -> DecoderArgs:
    """The decoder of a Qwen3 config (Qwen3-MoE's attention and dense layers too)."""
    heads = int(config["num_attention_heads"])
    return DecoderArgs(
        hidden_size=int(config["hidden_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim_of(config),
        vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=float(config["rope_theta"]),
        rope_traditional=False,
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
        qk_norm=True,
        tie_word_embeddings=tie_embeddings(config, has_lm_head, default=None),
    )
