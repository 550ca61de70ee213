"""SSD tier of the prompt cache: one verified file per entry, written atomically.

Layout (spec §1.13; the tokenizer hash is in the directory name too, so every incompatible
entry lives in a directory we never open — ignored, never deleted):

    <root>/<fingerprint16>-<scheme>-<tokenizer12>/<base | ns-<sha16>>/<uuid>.mlxkv
    <root>/<fingerprint16>-<scheme>-<tokenizer12>/quarantine/     (corrupt or mismatched files)
    <root>/<fingerprint16>-<scheme>-<tokenizer12>/.lock           (one server per directory)

File = a valid safetensors file. Its `__metadata__` holds our JSON header (format version,
model id, fingerprint, scheme, tokenizer hash, namespace, the exact token list, per-layer cache
kind / offset / trimmability, per-tensor dtype / shape / offset / sha256) and a sha256 over that
header plus the safetensors tensor table. Tensors are contiguous, C order, in file order.

Write: `<ns>/.<uuid>.mlxkv.tmp` → header with fixed-width hash placeholders → tensor pieces
(hashed as they are written) → the real header rewritten in place (same length) → fsync →
rename → directory fsync. A crash at any point leaves either no file or a complete one, plus at
worst a temp orphan, which the next start-up scan reaps.

Read: the header is verified at scan (hash, identity, namespace, size) and again at restore;
tensor hashes are checked at restore unless verification is off. Any doubt is a miss: the file
is moved to quarantine and dropped from the index.

Nothing here touches MLX: the store is used from the GPU-worker thread (find, read) and from a
writer thread (begin / write / commit), so the index is guarded by a lock. `cache/tiered.py`
turns arrays into KV caches and back on the MLX thread.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from cache.prompt_cache import common_prefix_length

log = logging.getLogger(__name__)

_RESTORE_THREADS = min(8, os.cpu_count() or 1)

FORMAT = "mlx-trio-kv"
FORMAT_VERSION = 1
SUFFIX = ".mlxkv"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16  # newest quarantined files kept for inspection; older ones are deleted
HEADER_ALIGN = 4096  # tensor data starts page-aligned
PIECE_BYTES = 4 << 20  # one write call (and one idle-gate check) covers at most this much
_HASH_PLACEHOLDER = "0" * 64
# Debug/fault-injection knob for the crash test: sleep this long before every piece write.
PIECE_DELAY_ENV = "MLX_TRIO_SSD_PIECE_DELAY_MS"

# safetensors dtype tag → numpy storage dtype (bf16 travels as its raw uint16 bits)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}


class SsdUnavailable(RuntimeError):
    """The SSD tier cannot be opened (locked by another server, unwritable, ...)."""


class SsdCorrupt(RuntimeError):
    """A file failed verification; the caller treats it as a miss and quarantines it."""


# --- identity ------------------------------------------------------------------------------------


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


_WEIGHT_SAMPLES = 16
_SAMPLE_BYTES = 4096


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
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype_name, dtype_name)


def namespace_dirname(namespace: str) -> str:
    return "base" if not namespace else "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:16]


# --- what travels from the MLX thread to the writer ------------------------------------------------


@attrs.frozen
class LayerMeta:
    kind: str  # "kv" (plain KVCache); other kinds are refused until they exist
    offset: int
    trimmable: bool
    tensors: tuple[str, ...]  # names of its tensors (keys, values)


@attrs.define(eq=False)
class SpillTensor:
    name: str
    dtype: str  # safetensors tag: F32 / F16 / BF16
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

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def trimmable(self) -> bool:
        return all(layer.trimmable for layer in self.layers)

    def release(self) -> None:
        """Drop the tensor views (and with them the pinned KV buffers)."""
        self.tensors = []


# --- the index -----------------------------------------------------------------------------------


@attrs.define(eq=False)
class IndexEntry:
    path: Path
    namespace: str
    ids: np.ndarray  # int64 tokens
    nbytes: int  # file size
    mtime: float
    trimmable: bool

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@attrs.define
class SsdStats:
    writes: int = 0  # files committed ("spills" in /stats)
    write_failures: int = 0
    refused: int = 0  # over the cap, empty, or an unsupported cache kind
    restores: int = 0
    restore_failures: int = 0
    quarantined: int = 0
    reaped_temp: int = 0
    evicted: int = 0
    superseded: int = 0


def _sha(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _blocks(arr: np.ndarray) -> Iterator[memoryview]:
    """C-order byte blocks of `arr` without copying where the layout allows (the KV views are
    contiguous per head, strided across heads), each at most PIECE_BYTES."""
    if arr.flags.c_contiguous:
        flat = memoryview(arr.reshape(-1)).cast("B") if arr.size else memoryview(b"")
        for start in range(0, len(flat), PIECE_BYTES):
            yield flat[start : start + PIECE_BYTES]
    elif arr.ndim > 2:
        for sub in arr:
            yield from _blocks(sub)
    else:
        yield from _blocks(np.ascontiguousarray(arr))


def _header_hash(header_json: str, table: dict[str, Any]) -> str:
    canon = json.dumps(table, sort_keys=True, separators=(",", ":"))
    return _sha((header_json + "\n" + canon).encode())


@attrs.frozen
class _Parsed:
    header: dict[str, Any]
    data_start: int
    file_size: int


class SsdStore:
    def __init__(
        self,
        root: Path | str,
        identity: Identity,
        *,
        max_bytes: int,
        verify: bool = True,
    ) -> None:
        self.root = Path(root)
        self.identity = identity
        self.dir = self.root / identity.dirname
        self.max_bytes = max(0, int(max_bytes))
        self.verify = verify
        self.stats = SsdStats()
        self._lock = threading.Lock()
        self._entries: dict[Path, IndexEntry] = {}
        self._bytes = 0
        self._lock_fd: int | None = None
        self._warned_write = False
        self._piece_delay = float(os.environ.get(PIECE_DELAY_ENV, "0") or 0) / 1000.0

    # -- lifecycle ------------------------------------------------------------------------------

    def open(self) -> SsdStore:
        """Take the directory lock, reap temp orphans, verify headers, build the index."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SsdUnavailable(f"cannot open SSD cache directory {self.dir}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SsdUnavailable(f"SSD cache {self.dir} is in use by another server") from None
            raise SsdUnavailable(f"cannot lock SSD cache {self.dir}: {e}") from None
        self._lock_fd = fd
        self._write_identity_note()
        self._scan()
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _write_identity_note(self) -> None:
        note = self.dir / "identity.json"
        body = json.dumps({"format": FORMAT, **attrs.asdict(self.identity)}, indent=1)
        try:
            if not note.exists() or note.read_text() != body:
                tmp = note.with_name(f".identity.{uuid.uuid4().hex}{TMP_SUFFIX}")
                tmp.write_text(body)
                os.replace(tmp, note)
        except OSError:
            pass  # informational only

    def _scan(self) -> None:
        found: list[IndexEntry] = []
        for nsdir in sorted(self.dir.iterdir()):
            if not nsdir.is_dir() or nsdir.name == QUARANTINE:
                continue
            for path in sorted(nsdir.iterdir()):
                name = path.name
                if name.endswith(TMP_SUFFIX):
                    try:
                        path.unlink()
                        self.stats.reaped_temp += 1
                    except OSError:
                        pass
                elif name.endswith(SUFFIX):
                    try:
                        found.append(self._index_entry(path, expect_nsdir=nsdir.name))
                    except Exception as e:  # noqa: BLE001 - any doubt is a quarantine
                        log.warning("SSD cache: quarantining %s: %s", path, e)
                        self._quarantine(path)
        for tmp in self.dir.glob(f".identity.*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        # Exact duplicates (a crash between a replacement's rename and the old file's unlink):
        # keep the newest.
        by_key: dict[tuple[str, bytes], IndexEntry] = {}
        for entry in sorted(found, key=lambda e: e.mtime):
            key = (entry.namespace, entry.ids.tobytes())
            older = by_key.get(key)
            if older is not None:
                older.path.unlink(missing_ok=True)
            by_key[key] = entry
        with self._lock:
            for entry in by_key.values():
                self._entries[entry.path] = entry
                self._bytes += entry.nbytes
            victims = self._evict_locked(keep=None)
        self._unlink_all(victims)
        if self.stats.reaped_temp or self.stats.quarantined:
            log.info(
                "SSD cache: reaped %d temp file(s), quarantined %d", self.stats.reaped_temp, self.stats.quarantined
            )
        log.info(
            "SSD cache %s: %d entries, %.1f MiB (cap %.1f GiB)",
            self.dir,
            len(self._entries),
            self._bytes / 2**20,
            self.max_bytes / 2**30,
        )

    # -- header ---------------------------------------------------------------------------------

    def _parse(self, f: Any, size: int) -> _Parsed:
        head = f.read(8)
        if len(head) != 8:
            raise SsdCorrupt("truncated file")
        n = struct.unpack("<Q", head)[0]
        if n > 256 << 20 or 8 + n > size:
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
        ident = self.identity
        for field, want in (
            ("fingerprint", ident.fingerprint),
            ("scheme", ident.scheme),
            ("tokenizer_hash", ident.tokenizer_hash),
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
        return _Parsed(header=header, data_start=8 + n, file_size=size)

    def _index_entry(self, path: Path, *, expect_nsdir: str) -> IndexEntry:
        st = path.stat()
        with open(path, "rb") as f:
            parsed = self._parse(f, st.st_size)
        header = parsed.header
        namespace = header["namespace"]
        if namespace_dirname(namespace) != expect_nsdir:
            raise SsdCorrupt("namespace does not match its directory")
        ids = np.asarray(header["tokens"], dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise SsdCorrupt("empty token key")
        return IndexEntry(
            path=path,
            namespace=namespace,
            ids=ids,
            nbytes=st.st_size,
            mtime=st.st_mtime,
            trimmable=all(layer["trimmable"] for layer in header["layers"]),
        )

    def _quarantine(self, path: Path) -> None:
        qdir = self.dir / QUARANTINE
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / f"{int(time.time())}-{path.parent.name}-{path.name}")
            self.stats.quarantined += 1
            kept = sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in kept[:-QUARANTINE_KEEP]:
                old.unlink(missing_ok=True)
        except FileNotFoundError:
            pass  # already gone (evicted or replaced meanwhile)
        except OSError:
            try:
                path.unlink()
            except OSError:
                pass

    # -- queries (any thread) -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def longest_durable_prefix_tokens(self) -> int:
        with self._lock:
            return max((e.length for e in self._entries.values()), default=0)

    def entries(self) -> list[IndexEntry]:
        with self._lock:
            return list(self._entries.values())

    def find(self, prompt: np.ndarray, namespace: str, cap: int) -> tuple[IndexEntry, int] | None:
        """The entry giving the longest usable prefix of `prompt` (at most `cap` tokens), and
        that length. Entries that would need a trim they cannot do are never candidates."""
        best: tuple[IndexEntry, int] | None = None
        best_key = (0, 0, 0.0)
        with self._lock:
            candidates = [e for e in self._entries.values() if e.namespace == namespace]
        for entry in candidates:
            usable = min(common_prefix_length(entry.ids, prompt), cap)
            if usable == 0:
                continue
            exact_fit = entry.length == usable
            if not exact_fit and not entry.trimmable:
                continue
            key = (usable, int(exact_fit), entry.mtime)
            if key > best_key:
                best, best_key = (entry, usable), key
        return best

    def has_exact(self, tokens: Sequence[int], namespace: str) -> bool:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        with self._lock:
            return any(
                e.namespace == namespace and e.length == ids.shape[0] and np.array_equal(e.ids, ids)
                for e in self._entries.values()
            )

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """An exact entry, or a longer trimmable one that starts with `tokens`, is on disk."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            return False
        with self._lock:
            for e in self._entries.values():
                if e.namespace != namespace or e.length < n or (e.length > n and not e.trimmable):
                    continue
                if e.ids[n - 1] == ids[n - 1] and np.array_equal(e.ids[:n], ids):
                    return True
        return False

    # -- restore (the MLX thread calls this, then builds caches) ---------------------------------

    def read(
        self, entry: IndexEntry, into: Callable[[list[tuple[str, str, list[int]]]], dict[str, np.ndarray]] | None = None
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(header, {tensor name: storage-dtype array}) of a verified entry; raises on any doubt
        (the caller quarantines via `discard`). `into([(name, dtype tag, shape)])`, when given,
        returns a writable flat uint8 buffer per tensor that the bytes are read into (and hashed
        in) instead of fresh numpy memory — the caller's own (MLX) arrays."""
        with open(entry.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            parsed = self._parse(f, size)
            header = parsed.header
            if header["namespace"] != entry.namespace or not np.array_equal(
                np.asarray(header["tokens"], dtype=np.int64), entry.ids
            ):
                raise SsdCorrupt("file changed under its index entry")
            fd = f.fileno()
            items = list(header["tensors"].items())
            dests = into([(name, t["dtype"], list(t["shape"])) for name, t in items]) if into else None

            def load(item: tuple[str, dict[str, Any]]) -> tuple[str, np.ndarray]:
                name, t = item
                buf = np.empty(t["nbytes"], dtype=np.uint8) if dests is None else dests[name]
                if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != t["nbytes"] or not buf.flags.writeable:
                    raise SsdCorrupt(f"tensor {name}: no buffer of {t['nbytes']} bytes to read into")
                if t["nbytes"] and os.preadv(fd, [memoryview(buf)], parsed.data_start + t["offset"]) != t["nbytes"]:
                    raise SsdCorrupt(f"tensor {name} truncated")
                if self.verify and _sha(buf) != t["hash"]:
                    raise SsdCorrupt(f"tensor {name} hash mismatch")
                return name, buf.view(STORAGE_DTYPES[t["dtype"]]).reshape(t["shape"])

            # Reads and sha256s release the GIL: a restore of a large KV (4k tokens of an 0.6B
            # model is 470 MB) runs them on several cores instead of one.
            if len(items) > 1 and _RESTORE_THREADS > 1:
                with concurrent.futures.ThreadPoolExecutor(min(_RESTORE_THREADS, len(items))) as pool:
                    arrays = dict(pool.map(load, items))
            else:
                arrays = dict(map(load, items))
        try:
            os.utime(entry.path)  # LRU by mtime
            entry.mtime = time.time()
        except OSError:
            pass
        self.stats.restores += 1
        return header, arrays

    def forget(self, entry: IndexEntry) -> None:
        """Drop an entry whose file is already gone (evicted or replaced by the writer meanwhile)."""
        with self._lock:
            if self._entries.pop(entry.path, None) is not None:
                self._bytes -= entry.nbytes

    def discard(self, entry: IndexEntry, reason: str) -> None:
        """Drop a bad entry: out of the index, file to quarantine."""
        log.warning("SSD cache: %s: %s; treating as a miss and quarantining it", entry.path.name, reason)
        self.stats.restore_failures += 1
        with self._lock:
            if self._entries.pop(entry.path, None) is not None:
                self._bytes -= entry.nbytes
        self._quarantine(entry.path)

    # -- store (a writer thread) ------------------------------------------------------------------

    def begin(self, item: SpillItem) -> SsdWriter | None:
        """Open a temp file for `item`; None when the store refuses it (nothing is written)."""
        if (
            not item.tokens
            or not item.layers
            or any(layer.kind != "kv" or layer.offset != len(item.tokens) for layer in item.layers)
            or item.nbytes > self.max_bytes
        ):
            self.stats.refused += 1
            return None
        nsdir = self.dir / namespace_dirname(item.namespace)
        if not nsdir.exists():
            nsdir.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.dir)
        return SsdWriter(self, item, nsdir)

    def _committed(self, entry: IndexEntry, trimmable: bool) -> None:
        with self._lock:
            victims: list[IndexEntry] = []
            n = entry.length
            for other in list(self._entries.values()):
                if other.namespace != entry.namespace:
                    continue
                same = other.length == n and np.array_equal(other.ids, entry.ids)
                # A trimmable entry serves every strict prefix of itself: its ancestors only cost space.
                ancestor = trimmable and other.length < n and np.array_equal(entry.ids[: other.length], other.ids)
                if same or ancestor:
                    victims.append(other)
                    self.stats.superseded += 1
            for v in victims:
                self._entries.pop(v.path, None)
                self._bytes -= v.nbytes
            self._entries[entry.path] = entry
            self._bytes += entry.nbytes
            victims += self._evict_locked(keep=entry.path)
            self.stats.writes += 1
        self._unlink_all(victims)

    def _evict_locked(self, keep: Path | None) -> list[IndexEntry]:
        victims = []
        while self._bytes > self.max_bytes:
            candidates = [e for e in self._entries.values() if e.path != keep]
            if not candidates:
                break
            oldest = min(candidates, key=lambda e: e.mtime)
            self._entries.pop(oldest.path)
            self._bytes -= oldest.nbytes
            self.stats.evicted += 1
            victims.append(oldest)
        return victims

    @staticmethod
    def _unlink_all(victims: list[IndexEntry]) -> None:
        for v in victims:
            try:
                v.path.unlink()
            except OSError:
                pass

    def _write_failed(self, e: BaseException) -> None:
        self.stats.write_failures += 1
        if not self._warned_write:
            self._warned_write = True
            log.warning("SSD cache: write failed (%s); entries that fail to write are future misses", e)


class SsdWriter:
    """One file being written. `write_next` writes one piece (<= PIECE_BYTES) and says whether
    more remain; `commit` publishes the file atomically; `abort` removes the temp file."""

    def __init__(self, store: SsdStore, item: SpillItem, nsdir: Path) -> None:
        self.store = store
        self.item = item
        name = uuid.uuid4().hex
        self.final = nsdir / f"{name}{SUFFIX}"
        self.tmp = nsdir / f".{name}{SUFFIX}{TMP_SUFFIX}"
        self._tensors: dict[str, dict[str, Any]] = {}
        offset = 0
        for t in item.tensors:
            self._tensors[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": t.nbytes,
                "hash": _HASH_PLACEHOLDER,
            }
            offset += t.nbytes
        self._created_at = time.time()
        self._hashers = [hashlib.sha256() for _ in item.tensors]
        self._pieces = ((i, block) for i, t in enumerate(item.tensors) for block in _blocks(t.data))
        self._written = [0] * len(item.tensors)
        self._header = self._encode_header()
        self._f = open(self.tmp, "wb")
        try:
            self._f.write(self._header)
        except BaseException:
            self.abort()
            raise

    def _encode_header(self) -> bytes:
        item, ident = self.item, self.store.identity
        header = {
            "format_version": FORMAT_VERSION,
            "created_at": self._created_at,
            "model_id": ident.model_id,
            "fingerprint": ident.fingerprint,
            "scheme": ident.scheme,
            "tokenizer_hash": ident.tokenizer_hash,
            "namespace": item.namespace,
            "tokens": list(item.tokens),
            "layers": [attrs.asdict(layer) for layer in item.layers],
            "tensors": self._tensors,
        }
        header_json = json.dumps(header, sort_keys=True, separators=(",", ":"))
        table: dict[str, Any] = {
            name: {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [t["offset"], t["offset"] + t["nbytes"]]}
            for name, t in self._tensors.items()
        }
        meta = {"format": FORMAT, "header": header_json, "header_hash": _header_hash(header_json, table)}
        body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
        padded = -(-(8 + len(body)) // HEADER_ALIGN) * HEADER_ALIGN - 8
        return struct.pack("<Q", padded) + body + b" " * (padded - len(body))

    def write_next(self) -> bool:
        piece = next(self._pieces, None)
        if piece is None:
            return False
        if self.store._piece_delay:
            time.sleep(self.store._piece_delay)
        i, block = piece
        try:
            self._f.write(block)
        except BaseException as e:
            self.store._write_failed(e)
            raise
        self._hashers[i].update(block)
        self._written[i] += len(block)
        return True

    def commit(self) -> bool:
        store = self.store
        try:
            while self.write_next():  # anything left (normally nothing)
                pass
            for (name, t), h, n in zip(self._tensors.items(), self._hashers, self._written):
                if n != t["nbytes"]:
                    raise RuntimeError(f"tensor {name}: wrote {n} of {t['nbytes']} bytes")
                t["hash"] = h.hexdigest()
            header = self._encode_header()
            if len(header) != len(self._header):
                raise RuntimeError("header length changed")  # cannot happen: fixed-width hashes
            self._f.seek(0)
            self._f.write(header)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.final)
            _fsync_dir(self.final.parent)
            st = self.final.stat()
        except Exception as e:  # noqa: BLE001 - a failed write is a future miss
            store._write_failed(e)
            self.abort()
            return False
        entry = IndexEntry(
            path=self.final,
            namespace=self.item.namespace,
            ids=np.asarray(self.item.tokens, dtype=np.int64),
            nbytes=st.st_size,
            mtime=st.st_mtime,
            trimmable=self.item.trimmable,
        )
        store._committed(entry, self.item.trimmable)
        return True

    def abort(self) -> None:
        try:
            self._f.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.tmp.unlink()
        except OSError:
            pass
