"""What travels from the MLX thread to the SSD writer: one entry's exact tokens, its per-layer
metadata and its tensors as numpy arrays (no MLX here: the writer runs on another thread)."""

from __future__ import annotations

import attrs
import numpy as np

# safetensors dtype tag -> numpy storage dtype (bf16 travels as its raw uint16 bits)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),  # a quantized layer's packed keys / values
}

KV = "kv"  # a full-precision KVCache: tensors keys, values
QKV = "qkv"  # a QuantizedKVCache: keys.{packed,scales,biases}, values.{packed,scales,biases}
TRIPLE = ("packed", "scales", "biases")
# layer kind -> its tensors' name suffixes, in file order
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    KV: ("keys", "values"),
    QKV: tuple(f"{kv}.{part}" for kv in ("keys", "values") for part in TRIPLE),
}


@attrs.frozen
class LayerMeta:
    kind: str  # KV or QKV (LAYER_TENSORS); other kinds are refused
    offset: int
    trimmable: bool
    tensors: tuple[str, ...]  # names of its tensors, in LAYER_TENSORS[kind]'s order
    # QKV only (None for KV): the quantization and the position the row turned quantized at,
    # which a restore must reproduce for the entry to equal a cold run.
    bits: int | None = None
    group_size: int | None = None
    converted_at: int | None = None

    @property
    def storable(self) -> bool:
        """A known kind with the fields its header record needs."""
        if self.kind == QKV:
            return None not in (self.bits, self.group_size, self.converted_at)
        return self.kind == KV


@attrs.define(eq=False)
class SpillTensor:
    name: str
    dtype: str  # safetensors tag: F32 / F16 / BF16 / U32
    shape: tuple[int, ...]
    # Storage-dtype numpy array; may be a strided zero-copy view of an evaluated MLX buffer
    # (MLX arrays are immutable values, so the memory cannot change under the writer).
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * STORAGE_DTYPES[self.dtype].itemsize


@attrs.define(eq=False)
class SpillItem:
    """One entry on its way to disk: exact tokens + materialized tensors + namespace."""

    namespace: str
    tokens: tuple[int, ...]
    layers: list[LayerMeta]
    tensors: list[SpillTensor]
    # A client's retention hint still running when the entry left RAM for the disk: the SSD tier
    # keeps it from eviction until then (wall-clock epoch seconds; None: an ordinary entry).
    retain_until: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def trimmable(self) -> bool:
        return all(layer.trimmable for layer in self.layers)

    def release(self) -> None:
        """Drop the tensor views (and with them the pinned KV buffers)."""
        self.tensors = []
