"""An adapter directory's `adapter_config.json`, read and checked field by field (no MLX).

One rule for the engine's mount (model/lora/load.py: a ValueError, the API's 400) and the
`--adapters-dir` listing (api/adapters/catalog.py: `compatible: false` with the reason). A field
of the wrong type or a non-finite `scale` (JSON's NaN / Infinity, or 1e400) is refused by name:
a NaN scale would mount and turn every adapted row's output into NaN logits.

Errors about the directory itself never say whether the path exists: whatever keeps the config
from being read (missing, a file, not permitted) is "not a readable adapter directory", since
the path comes from an API caller who may be probing the server's filesystem.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeGuard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
SUPPORTED_TYPES = ("lora", "dora")


def unreadable(path: Path | str) -> str:
    """The one message for a directory (or weights file) that cannot be read, whatever the cause."""
    return f"{path} is not a readable adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})"


def read_adapter_config(path: Path, adapter_id: str) -> dict[str, Any]:
    """The checked config of the adapter directory `path`; ValueError naming `adapter_id` and the
    field otherwise."""
    try:
        raw = (path / CONFIG_FILE).read_bytes()
    except OSError:
        raise ValueError(f"adapter {adapter_id!r}: {unreadable(path)}") from None
    try:
        config = json.loads(raw)
    except ValueError as e:  # (UnicodeDecodeError included)
        raise ValueError(f"adapter {adapter_id!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if problem := config_problem(config):
        raise ValueError(f"adapter {adapter_id!r}: {problem}")
    return config


def config_problem(config: Any) -> str | None:
    """Why `config` (parsed JSON) is not a usable LoRA / DoRA config, naming the field; None if it is."""
    if not isinstance(config, dict):
        return f"{CONFIG_FILE} is not a JSON object"
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        return 'a full fine-tune ("fine_tune_type": "full"), not a LoRA adapter: serve its weights as a model instead'
    if not isinstance(kind, str) or kind not in SUPPORTED_TYPES:
        return f'"fine_tune_type" must be one of {", ".join(SUPPORTED_TYPES)} (got {_shown(kind)})'
    layers = config.get("num_layers")
    if layers is not None and not _is_int(layers):
        return f'"num_layers" must be an integer (got {_shown(layers)})'
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        return f'{CONFIG_FILE} needs "lora_parameters" with "rank" and "scale"'
    rank, scale, keys = params.get("rank"), params.get("scale"), params.get("keys")
    if not _is_int(rank) or rank < 1:
        return f'"lora_parameters.rank" must be a positive integer (got {_shown(rank)})'
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return f'"lora_parameters.scale" must be a finite number (got {_shown(scale)})'
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        return f'"lora_parameters.keys" must be a list of module paths (strings) (got {_shown(keys)})'
    return None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A short JSON-ish rendering of a bad value for the message (NaN as NaN, long ones cut)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."
