"""Safetensors weights into a family model: single or sharded files, f32/f16/bf16, tied
embeddings, and the mlx-community affine quantized layout (weight/scales/biases, with per-module
overrides in config["quantization"]).

Arrays from `mx.load` are lazy and the model's own initial parameters are never evaluated, so
loading materializes exactly one copy of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model.load.errors import ModelLoadError


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e!r})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shard index names missing files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no model*.safetensors weights found")
    return files


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for path in weight_files(model_dir):
        try:
            arrays = mx.load(str(path))
        except Exception as e:  # mlx raises bare RuntimeError/ValueError for corrupt headers
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None
        if not isinstance(arrays, dict):  # (a .safetensors file always loads as a name -> array map)
            raise ModelLoadError(f"{path}: not a safetensors weight map")
        weights.update(arrays)
    return weights


def _quant_params(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, int]:
    """Infer group size and bits from the packed shapes, so overrides need no bookkeeping."""
    scales = weights[f"{path}.scales"]
    packed = weights[f"{path}.weight"]
    in_dims = module.weight.shape[-1]
    return {"group_size": in_dims // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_dims}


def apply_quantization(model: nn.Module, quant: dict[str, Any], weights: dict[str, mx.array]) -> None:
    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        override = quant.get(path)
        if isinstance(override, (bool, dict)):
            return override
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return _quant_params(path, module, weights)

    nn.quantize(
        model,
        group_size=int(quant["group_size"]),
        bits=int(quant["bits"]),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def load_into(model: nn.Module, weights: dict[str, mx.array], model_dir: Path) -> None:
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise ModelLoadError(f"{model_dir}: weights do not match config.json: {first_line}") from None
    mx.eval(model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # (a dict only when one is passed as `destination`)
    return sum(v.nbytes for _, v in flat)
