"""Model families: `model_type` → a function building `DecoderArgs` from config.json.

Adding a family = one file here that calls `register(...)`, plus its import below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model.errors import ModelLoadError
from model.layers import DecoderArgs

ArgsBuilder = Callable[[dict[str, Any], bool], DecoderArgs]
_FAMILIES: dict[str, ArgsBuilder] = {}


def register(*model_types: str) -> Callable[[ArgsBuilder], ArgsBuilder]:
    def add(builder: ArgsBuilder) -> ArgsBuilder:
        for t in model_types:
            _FAMILIES[t] = builder
        return builder

    return add


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def check_supported(model_type: str) -> ArgsBuilder:
    builder = _FAMILIES.get(model_type)
    if builder is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r} (supported: {', '.join(supported_model_types())})")
    return builder


def decoder_args(model_type: str, raw: dict[str, Any], has_lm_head: bool) -> DecoderArgs:
    """`has_lm_head`: the checkpoint ships lm_head.weight (decides tying when config is silent)."""
    builder = check_supported(model_type)
    try:
        return builder(raw, has_lm_head)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json for {model_type!r} is invalid: {e!r}") from None


def tie_embeddings(raw: dict[str, Any], has_lm_head: bool, *, default: bool | None) -> bool:
    """config's tie_word_embeddings, else the family default, else: tied iff no lm_head weight."""
    value = raw.get("tie_word_embeddings", default)
    return (not has_lm_head) if value is None else bool(value)


from model.families import llama, qwen2, qwen3  # noqa: E402,F401  (registration side effects)
