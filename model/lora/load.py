"""Read a LoRA / DoRA adapter in mlx-lm's layout and check it against a base model.

An adapter directory (what `mlx_lm.lora` writes) holds `adapter_config.json` and
`adapters.safetensors`. The config names the type ("lora", "dora" or "full"), how many of the last
layers are adapted (`num_layers`; -1 or 0 = all) and `lora_parameters` (`rank`, `scale`,
`dropout`, optional `keys`: module paths inside a layer, or at the model's top level such as
"lm_head"). Without `keys`, every linear of a layer is adaptable, as in mlx-lm. The safetensors
carry `<module>.lora_a` [in, rank], `<module>.lora_b` [rank, out] and, for DoRA, `<module>.m` [out].

The config's fields are checked by model/lora/config.py (shared with the `--adapters-dir`
listing). A module the config adapts but the file leaves out is unchanged (mlx-lm's zero-initialized
`lora_b` makes it a no-op there too). Dropout is the identity at inference.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.lora.config import WEIGHTS_FILE, read_adapter_config, unreadable
from model.lora.stack import DORA
from model.nn.language_model import LanguageModel

LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)
_LEAVES = ("lora_a", "lora_b", "m")
_MAX_LISTED = 5

# (layer index, module path inside the layer), or (None, module path) for a top-level module.
ModuleKey = tuple[int | None, str]


@attrs.frozen(eq=False)
class ModuleDelta:
    """One adapted linear's low-rank update: y = base(x) + scale * (x @ lora_a) @ lora_b.

    DoRA (`norm_scale` set): y = norm_scale * (x @ W.T + scale * (x @ lora_a) @ lora_b) + bias,
    with norm_scale = m / |W + scale * (lora_a @ lora_b).T| per output row, fixed for a frozen base."""

    lora_a: mx.array
    lora_b: mx.array
    scale: float
    norm_scale: mx.array | None = None

    @property
    def nbytes(self) -> int:
        extra = self.norm_scale.nbytes if self.norm_scale is not None else 0
        return self.lora_a.nbytes + self.lora_b.nbytes + extra


@attrs.define(eq=False)
class Adapter:
    """A loaded adapter: its arrays per adapted module, already checked against one base model."""

    id: str
    path: Path
    fine_tune_type: str
    rank: int
    scale: float
    modules: dict[ModuleKey, ModuleDelta]

    @property
    def is_dora(self) -> bool:
        return self.fine_tune_type == DORA

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.modules.values())


def is_wrapper(module: nn.Module) -> bool:
    """An installed adapter wrapper (model/lora/mount.py `AdaptedLinear`), seen as the linear it wraps."""
    return bool(getattr(module, "wraps_linear", False))


def base_linear(module: nn.Module) -> nn.Module:
    """The base linear of `module`: itself, or what an installed adapter wrapper wraps."""
    return module.base if is_wrapper(module) else module


def named_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """`root.named_modules()` with installed wrappers as leaves (their `.base` child hidden)."""
    pairs = root.named_modules()
    wrapped = [name + "." for name, m in pairs if is_wrapper(m)]
    return [(n, m) for n, m in pairs if not any(n.startswith(w) for w in wrapped)]


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input dims, output dims) of a Linear or a QuantizedLinear (packed: 32 // bits per uint32)."""
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


def dense_weight(linear: nn.Module) -> mx.array:
    """The base weight [out, in], dequantized when quantized (mlx-lm's DoRA works on this)."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear.weight


def layers_prefix(model: LanguageModel) -> str:
    """The parameter-name prefix of the blocks ("model.layers" for the shared decoder)."""
    layers = list(model.layers)
    if layers:
        for name, module in model.named_modules():
            if module is layers[0]:
                return name.rsplit(".", 1)[0]
    return "model.layers"


def adaptable_modules(model: LanguageModel, config: dict[str, Any]) -> dict[ModuleKey, nn.Module]:
    """The modules `config` adapts, as mlx-lm's `linear_to_lora_layers` picks them (any type)."""
    layers = list(model.layers)
    num_layers = int(config.get("num_layers", len(layers)))
    first = max(0, len(layers) - num_layers) if num_layers > 0 else 0
    keys = config["lora_parameters"].get("keys")
    if keys is None:  # every linear / embedding of every block
        keys = {
            name
            for layer in layers
            for name, module in named_modules(layer)
            if isinstance(module, (*LINEAR_TYPES, nn.Embedding, nn.QuantizedEmbedding)) or is_wrapper(module)
        }
    keys = set(keys)
    found: dict[ModuleKey, nn.Module] = {}
    for i in range(first, len(layers)):
        for name, module in named_modules(layers[i]):
            if name in keys:
                found[(i, name)] = module
    for name, module in named_modules(model):
        if name in keys:
            found[(None, name)] = module
    return found


def _split_name(name: str, prefix: str) -> tuple[ModuleKey, str] | None:
    """'model.layers.3.self_attn.q_proj.lora_a' -> ((3, 'self_attn.q_proj'), 'lora_a')."""
    module, _, leaf = name.rpartition(".")
    if leaf not in _LEAVES or not module:
        return None
    m = re.fullmatch(re.escape(prefix) + r"\.(\d+)\.(.+)", module)
    if m:
        return (int(m.group(1)), m.group(2)), leaf
    return (None, module), leaf


def _key_name(key: ModuleKey, prefix: str) -> str:
    layer, path = key
    return path if layer is None else f"{prefix}.{layer}.{path}"


def _check_module(
    key: ModuleKey, module: nn.Module | None, arrays: dict[str, mx.array], rank: int, dora: bool, prefix: str
) -> list[str]:
    name = _key_name(key, prefix)
    if module is None:
        return [f"{name}: not a module this adapter's config adapts in this model"]
    base = base_linear(module)
    if not isinstance(base, LINEAR_TYPES):
        return [f"{name}: a {type(base).__name__}, only Linear / QuantizedLinear layers can be adapted"]
    errors = [f"{name}.m: a DoRA magnitude in a plain LoRA adapter" for leaf in arrays if leaf == "m" and not dora]
    missing = [leaf for leaf in ("lora_a", "lora_b") if leaf not in arrays]
    if missing:
        return errors + [f"{name}: {' and '.join(missing)} missing"]
    in_dims, out_dims = linear_dims(base)
    want = {"lora_a": (in_dims, rank), "lora_b": (rank, out_dims), "m": (out_dims,)}
    for leaf, array in arrays.items():
        if tuple(array.shape) != want[leaf]:
            errors.append(f"{name}.{leaf}: shape {tuple(array.shape)}, the model needs {want[leaf]}")
    return errors


def _dora_norm_scale(base: nn.Module, a: mx.array, b: mx.array, scale: float, m: mx.array | None) -> mx.array:
    """m / |W + scale * B.T @ A.T| per output row: mlx-lm's DoRALinear ops, once instead of per call."""
    w = dense_weight(base)
    if m is None:  # mlx-lm's initial magnitude: the base rows' norms
        m = mx.linalg.norm(w.astype(mx.float32), axis=1)
    adapted = w + (scale * b.T) @ a.T
    return m / mx.linalg.norm(adapted, axis=1)


def _fail(adapter_id: str, errors: Iterable[str]) -> ValueError:
    listed = list(errors)
    more = f" (and {len(listed) - _MAX_LISTED} more)" if len(listed) > _MAX_LISTED else ""
    return ValueError(f"adapter {adapter_id!r} does not fit this model: {'; '.join(listed[:_MAX_LISTED])}{more}")


def load_adapter(path: str | Path, model: LanguageModel, adapter_id: str) -> Adapter:
    """Read the adapter at `path` and check every array against `model` (installed or not).

    Raises ValueError naming `adapter_id` for a directory that cannot be read, a config field
    that is wrong (model/lora/config.py), or any tensor that does not fit the model's modules."""
    path = Path(path)
    config = read_adapter_config(path, adapter_id)
    params = config["lora_parameters"]
    kind = config.get("fine_tune_type", "lora")
    rank, scale = int(params["rank"]), float(params["scale"])
    file = path / WEIGHTS_FILE
    try:
        with open(file, "rb"):  # (mx.load's own error would tell a missing file from a bad one)
            pass
    except OSError:
        raise ValueError(f"adapter {adapter_id!r}: {unreadable(path)}") from None
    try:
        loaded = mx.load(str(file))
    except Exception as e:  # mlx raises bare RuntimeError/ValueError for a corrupt file
        raise ValueError(f"adapter {adapter_id!r}: {WEIGHTS_FILE} is not a valid safetensors file ({e})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"adapter {adapter_id!r}: {file} is not a safetensors weight map")
    prefix = layers_prefix(model)
    targets = adaptable_modules(model, config)
    grouped: dict[ModuleKey, dict[str, mx.array]] = {}
    errors: list[str] = []
    for name, array in loaded.items():
        split = _split_name(name, prefix)
        if split is None:
            errors.append(f"{name}: not an adapter parameter (lora_a, lora_b or m)")
            continue
        key, leaf = split
        grouped.setdefault(key, {})[leaf] = array
    for key, arrays in grouped.items():
        errors += _check_module(key, targets.get(key), arrays, rank, kind == "dora", prefix)
    if errors:
        raise _fail(adapter_id, errors)
    modules: dict[ModuleKey, ModuleDelta] = {}
    for key, arrays in grouped.items():
        a, b = arrays["lora_a"], arrays["lora_b"]
        norm = _dora_norm_scale(base_linear(targets[key]), a, b, scale, arrays.get("m")) if kind == "dora" else None
        modules[key] = ModuleDelta(a, b, scale, norm)
    mx.eval([[d.lora_a, d.lora_b] + ([d.norm_scale] if d.norm_scale is not None else []) for d in modules.values()])
    return Adapter(id=adapter_id, path=path, fine_tune_type=kind, rank=rank, scale=scale, modules=modules)
