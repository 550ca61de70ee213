"""Qwen2 / Qwen2.5: the Llama decoder with biased q/k/v projections."""

from __future__ import annotations

from typing import Any

from model.families.common import tie_embeddings
from model.nn.decoder import DecoderArgs, DecoderModel

MODEL_TYPES: tuple[str, ...] = ("qwen2",)


def build(config: dict[str, Any], has_lm_head: bool) -> DecoderModel:
    heads = int(config["num_attention_heads"])
    return DecoderModel(
        DecoderArgs(
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config["hidden_size"]) // heads,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(config.get("rope_theta", 1000000.0)),
            rope_traditional=bool(config.get("rope_traditional", False)),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
            qkv_bias=True,
            tie_word_embeddings=tie_embeddings(config, has_lm_head, default=True),
        )
    )
