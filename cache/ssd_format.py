"""The SSD tier's file format: one entry per file, a valid safetensors file.

    u64 LE header length N | JSON header, space-padded so tensor data starts page-aligned | tensors

The safetensors header holds the tensor table and `__metadata__` = {format, header, header_hash}:
`header` is our JSON (format version, model id, fingerprint, scheme, tokenizer hash, namespace,
the exact token list, per-layer cache kind / offset / trimmability (and a quantized layer's
bits / group size / conversion point), per-tensor dtype / shape / offset / sha256) and
`header_hash` a sha256 over it plus the tensor table, so a flipped byte anywhere in the header
region fails the parse. Tensors are contiguous, C order, in file order.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, NotRequired, TypedDict, TypeGuard, cast

import attrs
import numpy as np

from cache.spill_item import KV, LAYER_TENSORS, QKV, STORAGE_DTYPES, LayerMeta
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
    dtype: str  # safetensors tag: F32 / F16 / BF16 / U32
    shape: list[int]
    offset: int  # from the start of the tensor data
    nbytes: int
    hash: str  # sha256 hex of the tensor's bytes


class LayerRecord(TypedDict):
    kind: str
    offset: int
    trimmable: bool
    tensors: list[str]
    # QKV layers only (a KV layer's record is as it always was, so older files read unchanged)
    bits: NotRequired[int]
    group_size: NotRequired[int]
    converted_at: NotRequired[int]


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
    # Put at a client's retention hint: kept from eviction until then (epoch seconds). Absent
    # otherwise, so a file without it reads as it always did.
    retain_until: NotRequired[float]


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
    retain_until: float | None = None,
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
        "layers": [_layer_record(layer) for layer in layers],
        "tensors": dict(tensors),
    }
    if retain_until is not None:
        header["retain_until"] = float(retain_until)
    header_json = json.dumps(header, sort_keys=True, separators=(",", ":"))
    table: dict[str, Any] = {
        name: {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [t["offset"], t["offset"] + t["nbytes"]]}
        for name, t in tensors.items()
    }
    meta = {"format": FORMAT, "header": header_json, "header_hash": _header_hash(header_json, table)}
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    padded = -(-(8 + len(body)) // HEADER_ALIGN) * HEADER_ALIGN - 8
    return struct.pack("<Q", padded) + body + b" " * (padded - len(body))


def _layer_record(layer: LayerMeta) -> LayerRecord:
    record: LayerRecord = {
        "kind": layer.kind,
        "offset": layer.offset,
        "trimmable": layer.trimmable,
        "tensors": list(layer.tensors),
    }
    if layer.kind == QKV:
        if layer.bits is None or layer.group_size is None or layer.converted_at is None:
            raise ValueError("a quantized layer needs bits, group_size and converted_at")
        record["bits"], record["group_size"] = layer.bits, layer.group_size
        record["converted_at"] = layer.converted_at
    return record


def parse_header(f: BinaryIO, size: int, identity: Identity) -> ParsedHeader:
    """Read and verify the header region of a `size`-byte file open at offset 0: header hash,
    format version, `identity`, tensor table against our header, sizes against shapes, file size,
    and every layer's coverage of the token key. Raises SsdCorrupt on any doubt."""
    try:
        return _parse_header(f, size, identity)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        # a field missing or of the wrong type (a hand-edited header that was re-hashed)
        raise SsdCorrupt(f"malformed header: {type(e).__name__}: {e}") from None


def _parse_header(f: BinaryIO, size: int, identity: Identity) -> ParsedHeader:
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
    tensors = header.get("tensors")
    if not isinstance(tensors, dict) or set(tensors) != set(table):
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
    if not isinstance(tokens, list) or not isinstance(header["layers"], list):
        raise SsdCorrupt("tokens / layers are not lists")
    for layer in header["layers"]:
        _check_layer(layer, tensors, len(tokens))
    retain_until = header.get("retain_until")
    if retain_until is not None and (not isinstance(retain_until, (int, float)) or isinstance(retain_until, bool)):
        raise SsdCorrupt("retain_until is not a number")
    return ParsedHeader(header=cast(Header, header), data_start=8 + n, file_size=size)


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_layer(layer: Any, tensors: Mapping[str, TensorRecord], n: int) -> None:
    """A layer record is one we can restore: a known kind, its fields, tensors covering the key
    with the shapes and dtypes of its kind. Raises SsdCorrupt otherwise."""
    if not isinstance(layer, dict) or layer.get("kind") not in LAYER_TENSORS:
        raise SsdCorrupt(f"unknown layer kind {layer.get('kind') if isinstance(layer, dict) else layer!r}")
    kind, names = layer["kind"], layer.get("tensors")
    if layer.get("offset") != n or not isinstance(layer.get("trimmable"), bool):
        raise SsdCorrupt("layer coverage does not match the token key")
    if not isinstance(names, list) or len(names) != len(LAYER_TENSORS[kind]):
        raise SsdCorrupt(f"a {kind} layer needs {len(LAYER_TENSORS[kind])} tensors")
    for name in names:
        if not isinstance(name, str) or name not in tensors:
            raise SsdCorrupt(f"layer tensor {name} missing")
        shape = tensors[name]["shape"]
        if len(shape) != 4 or shape[2] != n:
            raise SsdCorrupt(f"layer tensor {name} does not cover the key")
    if kind == KV:
        if any(tensors[name]["dtype"] == "U32" for name in names):
            raise SsdCorrupt("a full-precision layer holds packed words")
        return
    bits, group, at = layer.get("bits"), layer.get("group_size"), layer.get("converted_at")
    if not (_is_int(bits) and _is_int(group) and _is_int(at) and bits > 0 and group > 0 and 0 <= at <= n):
        raise SsdCorrupt("a quantized layer's bits / group_size / converted_at are missing or invalid")
    packed = [tensors[names[0]], tensors[names[3]]]
    groups = [tensors[name] for i, name in enumerate(names) if i % 3]
    # packed: [.., head_dim * bits / 32] uint32; scales, biases: [.., head_dim / group_size]
    if any(t["dtype"] != "U32" for t in packed) or any(t["dtype"] == "U32" for t in groups):
        raise SsdCorrupt("a quantized layer's tensor dtypes are wrong")
    for p, s, b in (packed[:1] + groups[:2], packed[1:] + groups[2:]):
        if p["shape"][:3] != s["shape"][:3] or s["shape"] != b["shape"] or s["dtype"] != b["dtype"]:
            raise SsdCorrupt("a quantized layer's tensor shapes disagree")
        if p["shape"][3] * 32 != s["shape"][3] * group * bits:
            raise SsdCorrupt("a quantized layer's packing does not match its bits / group_size")
