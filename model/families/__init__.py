"""Model families: each module serves some `model_type`s and builds their model (common.Family).

Adding a family = one module here, listed in FAMILIES.
"""

from __future__ import annotations

from typing import Any

from model.families import (
    gemma3_text,
    gemma4,
    gemma4_text,
    llama,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_5_vl,
    qwen3_moe,
    qwen3_next,
)
from model.families.common import Family
from model.load.errors import ModelLoadError
from model.nn.language_model import LanguageModel

FAMILIES: tuple[Family, ...] = (
    llama,
    qwen2,
    qwen3,
    qwen3_moe,
    gemma3_text,
    gemma4_text,
    gemma4,  # (after gemma4_text: it serves gemma4, building a text-only checkpoint there)
    qwen3_5,
    qwen3_5_vl,  # (after qwen3_5: it serves qwen3_5, building a text-only checkpoint there)
    qwen3_5_moe,
    qwen3_next,
    qwen2_5_vl,
)
_BY_TYPE: dict[str, Family] = {t: family for family in FAMILIES for t in family.MODEL_TYPES}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def family_for(model_type: str) -> Family:
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r} (supported: {', '.join(supported_model_types())})")
    return family


def build_model(model_type: str, config: dict[str, Any], has_lm_head: bool) -> LanguageModel:
    """The family's model for this config.json, its parameters not yet loaded."""
    family = family_for(model_type)
    try:
        return family.build(config, has_lm_head)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json for {model_type!r} is invalid: {e!r}") from None
