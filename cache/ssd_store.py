"""The SSD tier of the prompt cache: a directory of verified entry files and their index.

    <root>/<identity dirname>/<base | ns-<sha16>>/<uuid>.mlxkv   entries (cache/ssd_format.py)
    <root>/<identity dirname>/quarantine/                        corrupt or mismatched files
    <root>/<identity dirname>/.lock                              flock: one server per directory

The identity (model fingerprint, KV scheme, tokenizer hash) is in the directory name, so every
incompatible entry lives in a directory this store never opens: ignored, never deleted.

Read: the header is verified at scan (hash, identity, namespace, size) and again at restore;
tensor hashes are checked at restore unless verification is off. Any doubt is a miss: the file
is moved to quarantine and dropped from the index. Writes go through `SsdWriter`.

Nothing here touches MLX: the store is used from the GPU-worker thread (find, read) and from a
writer thread (begin / write / commit); the index guards itself with a lock. `cache/tiered.py`
turns arrays into KV caches and back on the MLX thread.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cache.spill_item import STORAGE_DTYPES, SpillItem
from cache.ssd_format import (
    FORMAT,
    SUFFIX,
    TMP_SUFFIX,
    Header,
    SsdCorrupt,
    TensorRecord,
    namespace_dirname,
    parse_header,
    sha256_hex,
)
from cache.ssd_identity import Identity
from cache.ssd_index import Dropped, IndexEntry, SsdIndex, covers
from cache.ssd_writer import SsdWriter, fsync_dir

log = logging.getLogger(__name__)

RESTORE_THREADS = min(8, os.cpu_count() or 1)
QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16  # newest quarantined files kept for inspection; older ones are deleted
# Entries the size cap pushed out, remembered (newest last) so a flush can tell an entry the cap
# evicted — the cache working as configured — from one that was lost.
EVICTIONS_KEPT = 4096

# (tensor name, dtype tag, shape) of each tensor a read is about to load.
TensorSpec = tuple[str, str, list[int]]
# Given the specs, a writable flat uint8 buffer per tensor to read into, or None for fresh ones.
ReadInto = Callable[[list[TensorSpec]], dict[str, np.ndarray] | None]


class SsdUnavailable(RuntimeError):
    """The SSD tier cannot be opened (locked by another server, unwritable, ...)."""


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
        self._index = SsdIndex()
        self._evicted: deque[IndexEntry] = deque(maxlen=EVICTIONS_KEPT)
        self._lock_fd: int | None = None
        self._warned_write = False

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
        self._drop(self._index.load(by_key.values(), self.max_bytes))
        if self.stats.reaped_temp or self.stats.quarantined:
            log.info(
                "SSD cache: reaped %d temp file(s), quarantined %d", self.stats.reaped_temp, self.stats.quarantined
            )
        log.info(
            "SSD cache %s: %d entries, %.1f MiB (cap %.1f GiB)",
            self.dir,
            len(self._index),
            self._index.nbytes / 2**20,
            self.max_bytes / 2**30,
        )

    def _index_entry(self, path: Path, *, expect_nsdir: str) -> IndexEntry:
        st = path.stat()
        with open(path, "rb") as f:
            header = parse_header(f, st.st_size, self.identity).header
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
            retain_until=header.get("retain_until"),
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

    def _drop(self, dropped: Dropped) -> None:
        """Count what the index pushed out and remove its files."""
        self.stats.superseded += len(dropped.superseded)
        self.stats.evicted += len(dropped.evicted)
        self._evicted.extend(dropped.evicted)
        for v in dropped.all:
            try:
                v.path.unlink()
            except OSError:
                pass

    # -- queries (any thread) -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def longest_durable_prefix_tokens(self) -> int:
        return self._index.longest

    def entries(self) -> list[IndexEntry]:
        return self._index.entries()

    def find(self, prompt: np.ndarray, namespace: str, cap: int) -> tuple[IndexEntry, int] | None:
        """The entry giving the longest usable prefix of `prompt` (at most `cap` tokens), and
        that length. Entries that would need a trim they cannot do are never candidates."""
        return self._index.find(prompt, namespace, cap)

    def has_exact(self, tokens: Sequence[int], namespace: str) -> bool:
        return self._index.has_exact(tokens, namespace)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """An exact entry, or a longer trimmable one that starts with `tokens`, is on disk."""
        return self._index.has_durable_prefix(tokens, namespace)

    def evicted_by_cap(self, tokens: Sequence[int], namespace: str) -> bool:
        """An entry that served `tokens` (exact, or longer and trimmable) was on disk and the size
        cap (--ssd-cache-max) evicted it: gone as configured, not lost."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.shape[0] == 0:
            return False
        evicted = list(self._evicted)  # one C-level copy: the writer thread may append meanwhile
        return any(covers(e, ids, namespace) for e in evicted)

    # -- restore (the MLX thread calls this, then builds caches) ---------------------------------

    def read(self, entry: IndexEntry, into: ReadInto | None = None) -> tuple[Header, dict[str, np.ndarray]]:
        """(header, {tensor name: storage-dtype array}) of a verified entry; raises on any doubt
        (the caller quarantines via `discard`). `into([(name, dtype tag, shape)])`, when given,
        returns a writable flat uint8 buffer per tensor that the bytes are read into (and hashed
        in) instead of fresh numpy memory — the caller's own (MLX) arrays."""
        with open(entry.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            parsed = parse_header(f, size, self.identity)
            header = parsed.header
            if header["namespace"] != entry.namespace or not np.array_equal(
                np.asarray(header["tokens"], dtype=np.int64), entry.ids
            ):
                raise SsdCorrupt("file changed under its index entry")
            fd = f.fileno()
            items = list(header["tensors"].items())
            dests = into([(name, t["dtype"], list(t["shape"])) for name, t in items]) if into else None

            def load(item: tuple[str, TensorRecord]) -> tuple[str, np.ndarray]:
                name, t = item
                buf = np.empty(t["nbytes"], dtype=np.uint8) if dests is None else dests[name]
                if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != t["nbytes"] or not buf.flags.writeable:
                    raise SsdCorrupt(f"tensor {name}: no buffer of {t['nbytes']} bytes to read into")
                if t["nbytes"] and os.preadv(fd, [buf.data], parsed.data_start + t["offset"]) != t["nbytes"]:
                    raise SsdCorrupt(f"tensor {name} truncated")
                if self.verify and sha256_hex(buf.data) != t["hash"]:
                    raise SsdCorrupt(f"tensor {name} hash mismatch")
                return name, buf.view(STORAGE_DTYPES[t["dtype"]]).reshape(t["shape"])

            # Reads and sha256s release the GIL: a restore of a large KV (4k tokens of an 0.6B
            # model is 470 MB) runs them on several cores instead of one.
            if len(items) > 1 and RESTORE_THREADS > 1:
                with concurrent.futures.ThreadPoolExecutor(min(RESTORE_THREADS, len(items))) as pool:
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
        self._index.remove(entry)

    def discard(self, entry: IndexEntry, reason: str) -> None:
        """Drop a bad entry: out of the index, file to quarantine."""
        log.warning("SSD cache: %s: %s; treating as a miss and quarantining it", entry.path.name, reason)
        self.stats.restore_failures += 1
        self._index.remove(entry)
        self._quarantine(entry.path)

    # -- store (a writer thread) ------------------------------------------------------------------

    def begin(self, item: SpillItem) -> SsdWriter | None:
        """Open a temp file for `item`; None when the store refuses it (nothing is written)."""
        if (
            not item.tokens
            or not item.layers
            or any(not layer.storable or layer.offset != len(item.tokens) for layer in item.layers)
            or item.nbytes > self.max_bytes
        ):
            self.stats.refused += 1
            return None
        nsdir = self.dir / namespace_dirname(item.namespace)
        if not nsdir.exists():
            nsdir.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.dir)
        return SsdWriter(self.identity, item, nsdir, on_commit=self._committed, on_failure=self._write_failed)

    def _committed(self, entry: IndexEntry) -> None:
        dropped = self._index.add(entry, self.max_bytes)
        self.stats.writes += 1
        self._drop(dropped)

    def _write_failed(self, e: BaseException) -> None:
        self.stats.write_failures += 1
        if not self._warned_write:
            self._warned_write = True
            log.warning("SSD cache: write failed (%s); entries that fail to write are future misses", e)
