"""Model configuration: config.json plus generation_config.json, validated into plain values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from model.load.errors import ModelLoadError


@attrs.frozen
class GenerationDefaults:
    """Sampling defaults a checkpoint ships in generation_config.json (None = not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None


@attrs.frozen
class ModelConfig:
    model_type: str
    raw: dict[str, Any]  # config.json as loaded (families read their own keys from it)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_position_embeddings: int
    generation: GenerationDefaults
    quantization: dict[str, Any] | None

    @property
    def hidden_size(self) -> int:
        return int(self.raw["hidden_size"])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent}: missing {path.name}") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value if isinstance(v, int))
    return ()


def load_config(model_dir: Path) -> ModelConfig:
    raw = _read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{model_dir / 'config.json'}: no model_type")
    # generation_config.json's eos overrides config.json's (mlx-lm's rule).
    eos = _ids(gen.get("eos_token_id")) or _ids(raw.get("eos_token_id"))
    bos = gen.get("bos_token_id", raw.get("bos_token_id"))
    quant = raw.get("quantization") or raw.get("quantization_config")
    if quant is not None and not ("group_size" in quant and "bits" in quant):
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ModelLoadError(
            f"{model_dir}: unsupported quantization {method!r} (supported: mlx-community affine {{group_size, bits}})"
        )
    return ModelConfig(
        model_type=model_type,
        raw=raw,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 32768),
        generation=GenerationDefaults(
            temperature=_opt(gen.get("temperature"), float),
            top_p=_opt(gen.get("top_p"), float),
            top_k=_opt(gen.get("top_k"), int),
            repetition_penalty=_opt(gen.get("repetition_penalty"), float),
        ),
        quantization=quant,
    )


def _opt(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)
