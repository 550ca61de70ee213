"""What KV compatibility depends on: the model's weights, the KV dtype and the tokenizer.

The SSD tier keeps each identity's entries in a directory of its own, named by `Identity.dirname`,
so entries of another model, dtype or tokenizer sit in a directory it never opens.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import attrs

from model.kv.scheme import dtype_label

_WEIGHT_SAMPLES = 16
_SAMPLE_BYTES = 4096


@attrs.frozen
class Identity:
    """What KV compatibility depends on. Files of another identity are never read."""

    model_id: str
    fingerprint: str  # sha256 hex of config.json + a sample of the weights
    scheme: str  # KV scheme key: the cache dtype (bf16 / f16 / f32); no KV quantization yet
    tokenizer_hash: str  # sha256 hex of tokenizer.json

    @property
    def dirname(self) -> str:
        return f"{self.fingerprint[:16]}-{self.scheme}-{self.tokenizer_hash[:12]}"


def model_fingerprint(model_dir: Path) -> str:
    """sha256 of the canonical config.json plus, per weight shard, its size, its safetensors
    header and 16 evenly spaced 4 KiB samples of its data. The config alone would let a
    fine-tune (same config, same tokenizer) read its base model's KV: a wrong result."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for shard in sorted(model_dir.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"\0{shard.name}\0{size}\0".encode())
        with open(shard, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                n = min(struct.unpack("<Q", head)[0], 64 << 20)
                h.update(f.read(n))
            for i in range(_WEIGHT_SAMPLES):
                f.seek(size * i // _WEIGHT_SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def tokenizer_hash(model_dir: Path) -> str:
    """sha256 of tokenizer.json (or of the sentencepiece / vocab files when there is none)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    names = (
        ["tokenizer.json"]
        if (model_dir / "tokenizer.json").exists()
        else sorted(p.name for p in model_dir.iterdir() if p.name in ("tokenizer.model", "vocab.json", "merges.txt"))
    )
    for name in names:
        h.update(name.encode() + b"\0")
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()


def scheme_key(dtype_name: str) -> str:
    """The KV scheme key of an MLX dtype name (bfloat16 -> bf16): the label /v1/models shows."""
    return dtype_label(dtype_name)
