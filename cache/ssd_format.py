"""The SSD tier's file format: one entry per file, a valid safetensors file.

    u64 LE header length N | JSON header, space-padded so tensor data starts page-aligned | tensors

The safetensors header holds the tensor table and `__metadata__` = {format, header, header_hash}:
`header` is our JSON (format version, model id, fingerprint, scheme, tokenizer hash, namespace,
the exact token list, per-layer cache kind / offset / trimmability, per-tensor dtype / shape /
offset / sha256) and `header_hash` a sha256 over it plus the tensor table, so a flipped byte
anywhere in the header region fails the parse. Tensors are contiguous, C order, in file order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, TypedDict, cast

import attrs
import numpy as np

from cache.spill_item import STORAGE_DTYPES, LayerMeta
from cache.ssd_identity import Identity

FORMAT = "mlx-trio-kv"
FORMAT_VERSION = 1
SUFFIX = ".mlxkv"
TMP_SUFFIX = ".tmp"
HEADER_ALIGN = 4096  # tensor data starts page-aligned
# Tensor hashes are written as this first and rewritten in place once known: same length.
HASH_PLACEHOLDER = "0" * 64
_MAX_HEADER = 256 << 20


class SsdCorrupt(RuntimeError):
    """A file failed verification; the caller treats it as a miss and quarantines it."""


class TensorRecord(TypedDict):
    dtype: str  # safetensors tag: F32 / F16 / BF16
    shape: list[int]
    offset: int  # from the start of the tensor data
    nbytes: int
    hash: str  # sha256 hex of the tensor's bytes


class LayerRecord(TypedDict):
    kind: str
    offset: int
    trimmable: bool
    tensors: list[str]


class Header(TypedDict):
    format_version: int
    created_at: float
    model_id: str
    fingerprint: str
    scheme: str
    tokenizer_hash: str
    namespace: str
    tokens: list[int]
    layers: list[LayerRecord]
    tensors: dict[str, TensorRecord]


@attrs.frozen
class ParsedHeader:
    header: Header
    data_start: int  # file offset of the tensor data
    file_size: int


def namespace_dirname(namespace: str) -> str:
    """The directory of a namespace's entries (the base model's: "base")."""
    return "base" if not namespace else "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:16]


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _header_hash(header_json: str, table: Mapping[str, Any]) -> str:
    canon = json.dumps(table, sort_keys=True, separators=(",", ":"))
    return sha256_hex((header_json + "\n" + canon).encode())


def encode_header(
    identity: Identity,
    *,
    created_at: float,
    namespace: str,
    tokens: Sequence[int],
    layers: Sequence[LayerMeta],
    tensors: Mapping[str, TensorRecord],
) -> bytes:
    """The file's header region: length prefix, safetensors JSON, padding to HEADER_ALIGN. Its
    length depends only on the tensor layout, never on the hash values."""
    header: Header = {
        "format_version": FORMAT_VERSION,
        "created_at": created_at,
        "model_id": identity.model_id,
        "fingerprint": identity.fingerprint,
        "scheme": identity.scheme,
        "tokenizer_hash": identity.tokenizer_hash,
        "namespace": namespace,
        "tokens": list(tokens),
        "layers": [
            {"kind": layer.kind, "offset": layer.offset, "trimmable": layer.trimmable, "tensors": list(layer.tensors)}
            for layer in layers
        ],
        "tensors": dict(tensors),
    }
    header_json = json.dumps(header, sort_keys=True, separators=(",", ":"))
    table: dict[str, Any] = {
        name: {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [t["offset"], t["offset"] + t["nbytes"]]}
        for name, t in tensors.items()
    }
    meta = {"format": FORMAT, "header": header_json, "header_hash": _header_hash(header_json, table)}
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    padded = -(-(8 + len(body)) // HEADER_ALIGN) * HEADER_ALIGN - 8
    return struct.pack("<Q", padded) + body + b" " * (padded - len(body))


def parse_header(f: BinaryIO, size: int, identity: Identity) -> ParsedHeader:
    """Read and verify the header region of a `size`-byte file open at offset 0: header hash,
    format version, `identity`, tensor table against our header, sizes against shapes, file size,
    and every layer's coverage of the token key. Raises SsdCorrupt on any doubt."""
    head = f.read(8)
    if len(head) != 8:
        raise SsdCorrupt("truncated file")
    n = struct.unpack("<Q", head)[0]
    if n > _MAX_HEADER or 8 + n > size:
        raise SsdCorrupt("bad header length")
    try:
        table = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise SsdCorrupt(f"unreadable header: {e}") from None
    if not isinstance(table, dict):
        raise SsdCorrupt("header is not an object")
    meta = table.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SsdCorrupt("not an mlx-trio KV file")
    header_json = meta.get("header")
    if not isinstance(header_json, str) or meta.get("header_hash") != _header_hash(header_json, table):
        raise SsdCorrupt("header hash mismatch")
    header = json.loads(header_json)
    if header.get("format_version") != FORMAT_VERSION:
        raise SsdCorrupt(f"format version {header.get('format_version')}")
    for field, want in (
        ("fingerprint", identity.fingerprint),
        ("scheme", identity.scheme),
        ("tokenizer_hash", identity.tokenizer_hash),
    ):
        if header.get(field) != want:
            raise SsdCorrupt(f"{field} mismatch")
    total = 0
    tensors = header["tensors"]
    if set(tensors) != set(table):
        raise SsdCorrupt("tensor table mismatch")
    for name, t in tensors.items():
        entry = table[name]
        if (
            entry.get("dtype") != t["dtype"]
            or list(entry.get("shape", ())) != list(t["shape"])
            or list(entry.get("data_offsets", ())) != [t["offset"], t["offset"] + t["nbytes"]]
        ):
            raise SsdCorrupt(f"tensor {name} table mismatch")
        if t["dtype"] not in STORAGE_DTYPES:
            raise SsdCorrupt(f"tensor {name} dtype {t['dtype']}")
        if int(np.prod(t["shape"], dtype=np.int64)) * STORAGE_DTYPES[t["dtype"]].itemsize != t["nbytes"]:
            raise SsdCorrupt(f"tensor {name} size mismatch")
        total = max(total, t["offset"] + t["nbytes"])
    if 8 + n + total != size:
        raise SsdCorrupt(f"file size {size} != {8 + n + total}")
    tokens = header["tokens"]
    for layer in header["layers"]:
        if layer["kind"] != "kv" or layer["offset"] != len(tokens):
            raise SsdCorrupt("layer coverage does not match the token key")
        for name in layer["tensors"]:
            if name not in tensors or tensors[name]["shape"][2] != len(tokens):
                raise SsdCorrupt(f"layer tensor {name} does not cover the key")
    return ParsedHeader(header=cast(Header, header), data_start=8 + n, file_size=size)
