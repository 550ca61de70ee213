"""How the KV cache stores keys and values: full precision, or affine-quantized per layer.

`--kv-quant 8|4` quantizes every layer (mlx-lm's `kv_bits`); `--kv-quant config` reads the
model's `kv_config.json`; `off` keeps the activation dtype. The quantization is mlx-lm's:
`mx.quantize` over groups of `group_size` along the head dimension, and a row's caches turn
quantized after the first forward (a prefill chunk, a join, a decode step) that leaves them
holding at least `start` positions (mlx-lm's `quantized_kv_start`). Prefill chunks end on
multiples of the chunk size, as mlx-lm's generate does, so the turning point, and with it every
token, is mlx-lm's (`conversion_point`).

kv_config.json: {"group_size": 64, "bits": 8, "layers": {"0": 4, "3": null, ...}} — `bits` is
the default for unnamed layers (null = full precision), a layer may name its own bits or null.

`--paged-kv` (`paged`) changes only how a batch of rows holds its full-precision full-attention
layers (model/kv/paged.py, merged by model/kv/rows.py): what a row computes and what the prompt
cache keeps are the same either way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from model.options import KVOptions
from model.options.flags import default_of

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
KV_CONFIG_FILE = "kv_config.json"


@attrs.frozen
class LayerQuant:
    bits: int
    group_size: int


@attrs.frozen
class KVScheme:
    """`layers[i]` is layer i's quantization (None = full precision); an empty tuple = all off."""

    mode: str = "off"  # "off" | "4" | "8" | "config": what the operator asked for
    layers: tuple[LayerQuant | None, ...] = ()
    start: int = default_of(KVOptions, "quantized_kv_start")
    # --paged-kv: a batch's full-attention layers keep their rows in blocks (model/kv/paged.py).
    # Not part of `cache_key`: rows leave a paged batch as the same solo caches.
    paged: bool = default_of(KVOptions, "paged_kv")

    @property
    def quantized(self) -> bool:
        return any(q is not None for q in self.layers)

    def layer(self, i: int) -> LayerQuant | None:
        return self.layers[i] if i < len(self.layers) else None

    @property
    def label(self) -> str:
        """What /stats and /v1/models show ("full" unquantized: `labelled` names the dtype)."""
        if not self.quantized:
            return "full"
        if self.mode == "config":
            return "mixed (kv_config.json)"
        q = next(q for q in self.layers if q is not None)
        return f"kv{q.bits}"

    def labelled(self, dtype_name: str) -> str:
        """The label, unquantized KV named by its dtype ("bfloat16" -> bf16, f16, f32)."""
        return self.label if self.quantized else dtype_label(dtype_name)

    @property
    def group_size(self) -> int | None:
        """The quantized layers' group size (a scheme has one); None when nothing is quantized."""
        return next((q.group_size for q in self.layers if q is not None), None)

    @property
    def bits(self) -> int | tuple[int | None, ...] | None:
        """What /stats shows: None when nothing is quantized, the bits when every layer has the
        same, else each layer's (None = full precision)."""
        if not self.quantized:
            return None
        per_layer = tuple(None if q is None else q.bits for q in self.layers)
        return per_layer[0] if len(set(per_layer)) == 1 else per_layer

    @property
    def cache_key(self) -> str:
        """Names the stored representation: prompt-cache entries of one scheme never serve
        another (it prefixes the cache namespace and so the SSD tier's keys too)."""
        if not self.quantized:
            return ""
        spec = ",".join("-" if q is None else f"{q.bits}/{q.group_size}" for q in self.layers)
        digest = hashlib.sha256(f"{spec}@{self.start}".encode()).hexdigest()[:12]
        return f"{self.label.split()[0]}:{digest}"

    def layer_ratio(self, i: int, dtype_bytes: int) -> float:
        """Bytes of layer i's stored KV per full-precision byte: bits/8 per element plus a scale
        and a bias (activation dtype) per group."""
        q = self.layer(i)
        if q is None:
            return 1.0
        return (q.bits / 8 + 2 * dtype_bytes / q.group_size) / dtype_bytes

    def ratio(self, num_layers: int, dtype_bytes: int) -> float:
        """The mean over layers of `layer_ratio` (every layer holds the same KV shape)."""
        if num_layers <= 0 or not self.quantized:
            return 1.0
        return sum(self.layer_ratio(i, dtype_bytes) for i in range(num_layers)) / num_layers

    def conversion_point(self, prompt_length: int, chunk: int) -> int:
        """The first position whose forward attends quantized keys, for a cold run of a prompt of
        `prompt_length` tokens prefilled in `chunk`-token chunks (the last prompt token is fed
        alone, then one token per decode step): the first chunk end at or past `start`, else the
        join (the prompt's length) or the decode step that reaches `start`."""
        todo = prompt_length - 1
        first_end = max(1, -(-self.start // chunk)) * chunk
        if first_end <= todo:
            return first_end
        if todo >= max(self.start, 1):
            return todo  # the last (partial) chunk reaches start
        return max(self.start, prompt_length)


def uniform(bits: int, group_size: int, start: int, num_layers: int) -> KVScheme:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"--kv-quant {bits}: bits must be one of {', '.join(map(str, SUPPORTED_BITS))}")
    _check_group(group_size)
    return KVScheme(str(bits), (LayerQuant(bits, group_size),) * num_layers, start)


def _check_group(group_size: int) -> None:
    if group_size not in (32, 64, 128):
        raise ValueError(f"--kv-group-size {group_size}: must be 32, 64 or 128")


def from_config(model_dir: Path, num_layers: int, group_size: int, start: int) -> KVScheme:
    """`--kv-quant config`: the model's kv_config.json, or full precision when it ships none."""
    path = model_dir / KV_CONFIG_FILE
    if not path.is_file():
        return KVScheme("config", (), start)
    try:
        raw: Any = json.loads(path.read_text())
        group = int(raw.get("group_size", group_size))
        _check_group(group)
        default = raw.get("bits")
        named = {int(k): v for k, v in (raw.get("layers") or {}).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a kv_config ({e})") from e
    layers: list[LayerQuant | None] = []
    for i in range(num_layers):
        bits = named.get(i, default)
        if bits is not None and int(bits) not in SUPPORTED_BITS:
            raise ValueError(f"{path}: layer {i} bits {bits} (supported: {SUPPORTED_BITS})")
        layers.append(None if bits is None else LayerQuant(int(bits), group))
    return KVScheme("config", tuple(layers), start)


def resolve(options: KVOptions, *, model_dir: Path | None, num_layers: int) -> KVScheme:
    """The scheme `options` (--kv-quant and its knobs, --paged-kv) give a model of `num_layers` layers."""
    return attrs.evolve(_storage(options, model_dir=model_dir, num_layers=num_layers), paged=options.paged_kv)


def _storage(options: KVOptions, *, model_dir: Path | None, num_layers: int) -> KVScheme:
    mode, group_size, start = options.kv_quant, options.kv_group_size, options.quantized_kv_start
    if mode == "off":
        return KVScheme("off", (), start)
    if mode == "config":
        return from_config(model_dir, num_layers, group_size, start) if model_dir else KVScheme("config", (), start)
    try:
        bits = int(mode)
    except ValueError:
        raise ValueError(f"--kv-quant {mode!r}: expected off, config, 4 or 8") from None
    return uniform(bits, group_size, start, num_layers)


def dtype_label(dtype_name: str) -> str:
    """bf16, f16, f32 for the float dtypes ("bfloat16" or "mlx.core.bfloat16"); another its own name."""
    name = dtype_name.rsplit(".", 1)[-1]
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(name, name)
