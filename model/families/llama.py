"""Llama 2/3/3.1 (incl. llama3 rope scaling) and Mistral: the plain pre-norm SwiGLU decoder."""

from __future__ import annotations

from typing import Any

from model.families.common import head_dim_of, tie_embeddings
from model.nn.decoder import DecoderArgs, DecoderModel

MODEL_TYPES: tuple[str, ...] = ("llama", "mistral")


def build(config: dict[str, Any], has_lm_head: bool) -> DecoderModel:
    heads = int(config["num_attention_heads"])
    return DecoderModel(
        DecoderArgs(
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim_of(config),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_traditional=bool(config.get("rope_traditional", False)),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            # HF's default for these families is untied; a checkpoint without lm_head is tied.
            tie_word_embeddings=tie_embeddings(config, has_lm_head, default=None),
        )
    )
