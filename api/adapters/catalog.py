"""GET /v1/adapters/available: the adapter directories under `--adapters-dir`, and whether each
fits the served model.

Each subdirectory holding an `adapter_config.json` is one entry: `id` (the directory's name),
`path`, `fine_tune_type`, `rank`, `num_layers` and `compatible`. Compatibility is decided
cheaply, without the MLX thread and without reading any weights: the safetensors header of
`adapters.safetensors` (its JSON table of names and shapes) is compared with the base model's
config.json. Every `lora_a` must be (in, rank) and every `lora_b` (rank, out) for the module it
names, in a layer the model has, with (in, out) from the hidden / intermediate / head sizes; a
full fine-tune, a config field of the wrong type (model/lora/config.py, the mount's own rule)
or an unreadable file is `false`. A module those sizes do not describe (another
family's naming) gives `"unknown"`: mounting (POST /v1/adapters) is the real check.
An entry that is not `true` carries a `reason`.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from model.lora.config import CONFIG_FILE, WEIGHTS_FILE, config_problem
from model.lora.ids import adapter_id_problem

MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header past this is not an adapter's
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.(lora_a|lora_b)$")
_TOP_KEY = re.compile(r"^(?:model\.)?([A-Za-z_][\w]*)\.(lora_a|lora_b)$")


def scan(adapters_dir: Path, model_config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every adapter directory directly under `adapters_dir`, sorted by id (blocking: file reads)."""
    out = []
    for entry in sorted(adapters_dir.iterdir()) if adapters_dir.is_dir() else []:
        if entry.is_dir() and (entry / CONFIG_FILE).is_file():
            out.append(describe(entry, model_config))
    return out


def describe(path: Path, model_config: dict[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": path.name,
        "path": str(path),
        "fine_tune_type": None,
        "rank": None,
        "num_layers": None,
    }
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    except (OSError, ValueError) as exc:
        return {**entry, "compatible": False, "reason": f"unreadable {CONFIG_FILE}: {exc}"}
    if problem := config_problem(config):  # (its bad values are not echoed as fields)
        return {**entry, "compatible": False, "reason": problem}
    rank = config["lora_parameters"]["rank"]
    entry.update(fine_tune_type=config.get("fine_tune_type", "lora"), rank=rank, num_layers=config.get("num_layers"))
    compatible, reason = check(path, rank, model_config)
    if compatible is not False and (problem := adapter_id_problem(path.name)):
        compatible, reason = False, f"{problem}: rename the directory"  # POST /v1/adapters would refuse it
    entry["compatible"] = compatible
    if compatible is not True:
        entry["reason"] = reason
    return entry


def check(path: Path, rank: int, model_config: dict[str, Any] | None) -> tuple[bool | str, str]:
    """(true | false | "unknown", why not) for a directory whose config passed `config_problem`."""
    try:
        shapes = header_shapes(path / WEIGHTS_FILE)
    except (OSError, ValueError) as exc:
        return False, f"unreadable {WEIGHTS_FILE}: {exc}"
    if model_config is None:
        return "unknown", "the base model's config.json could not be read"
    return fits(shapes, rank, model_config)


def header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header alone (8-byte length, then JSON)."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"header of {length} bytes")
        table = json.loads(f.read(length))
    if not isinstance(table, dict):
        raise ValueError("the header is not a JSON object")
    return {k: list(v.get("shape", [])) for k, v in table.items() if k != "__metadata__" and isinstance(v, dict)}


def module_dims(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable linear of a decoder block, and of `lm_head`."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv * head_dim),
        "self_attn.v_proj": (hidden, kv * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
        "lm_head": (hidden, int(config["vocab_size"])),
    }


def fits(shapes: dict[str, list[int]], rank: int, config: dict[str, Any]) -> tuple[bool | str, str]:
    try:
        dims = module_dims(config)
        layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return "unknown", "the base model's config.json lacks the sizes to compare with"
    lora = [name for name in shapes if name.endswith((".lora_a", ".lora_b"))]
    if not lora:
        return False, f"{WEIGHTS_FILE} holds no lora_a / lora_b arrays"
    unknown = None
    for name in lora:
        layer_match = _LAYER_KEY.search(name)
        top_match = None if layer_match else _TOP_KEY.match(name)
        if layer_match:
            if int(layer_match.group(1)) >= layers:
                return False, f"{name}: the model has {layers} layers"
            module, which = layer_match.group(2), layer_match.group(3)
        elif top_match:
            module, which = top_match.group(1), top_match.group(2)
        else:
            unknown = unknown or name
            continue
        if module not in dims:
            unknown = unknown or name
            continue
        in_dims, out_dims = dims[module]
        want = [in_dims, rank] if which == "lora_a" else [rank, out_dims]
        if shapes[name] != want:
            return False, f"{name} has shape {shapes[name]}, the model needs {want}"
    if unknown is not None:
        return "unknown", f"{unknown}: a module these sizes do not describe (mounting checks it)"
    return True, ""


def read_model_config(model_dir: Path | None) -> dict[str, Any] | None:
    if model_dir is None:
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("text_config"), dict):  # a wrapped language model's own sizes
        config = {**config, **config["text_config"]}
    return config
