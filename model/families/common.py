"""What every family module provides, and the config.json helpers they share."""

from __future__ import annotations

from typing import Any, Protocol

from model.nn.language_model import LanguageModel


class Family(Protocol):
    """A family module: the `model_type`s it serves and how it builds their model from config.json.

    `build` may return any `LanguageModel` subclass, with blocks of its own; `has_lm_head`: the
    checkpoint ships lm_head.weight (decides tying when the config is silent). Bad or missing
    config keys raise KeyError, TypeError or ValueError.
    """

    MODEL_TYPES: tuple[str, ...]

    def build(self, config: dict[str, Any], has_lm_head: bool) -> LanguageModel: ...


def tie_embeddings(config: dict[str, Any], has_lm_head: bool, *, default: bool | None) -> bool:
    """config's tie_word_embeddings, else the family default, else: tied iff no lm_head weight."""
    value = config.get("tie_word_embeddings", default)
    return (not has_lm_head) if value is None else bool(value)


def head_dim_of(config: dict[str, Any]) -> int:
    """An explicit head_dim, else hidden_size / heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
