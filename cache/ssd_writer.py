"""Writing one SSD-tier file atomically, a piece at a time (on a writer thread, never MLX's).

`<ns>/.<uuid>.mlxkv.tmp` <- header with placeholder hashes <- tensor pieces (hashed as they are
written) <- the real header rewritten in place (same length) <- fsync <- rename to `<uuid>.mlxkv`
<- directory fsync. A crash at any point leaves either no file or a complete one, plus at worst
a temp orphan, which the next start-up scan reaps.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from cache.spill_item import SpillItem
from cache.ssd_format import HASH_PLACEHOLDER, SUFFIX, TMP_SUFFIX, TensorRecord, encode_header
from cache.ssd_identity import Identity
from cache.ssd_index import IndexEntry

PIECE_BYTES = 4 << 20  # one write call (and one idle-gate check) covers at most this much
# Seconds to sleep before every piece write: 0 in service. The crash test raises it so that a
# kill -9 lands mid-file.
PIECE_DELAY_S = 0.0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _blocks(arr: np.ndarray) -> Iterator[memoryview]:
    """C-order byte blocks of `arr` without copying where the layout allows (the KV views are
    contiguous per head, strided across heads), each at most PIECE_BYTES."""
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1).data.cast("B") if arr.size else memoryview(b"")
        for start in range(0, len(flat), PIECE_BYTES):
            yield flat[start : start + PIECE_BYTES]
    elif arr.ndim > 2:
        for sub in arr:
            yield from _blocks(sub)
    else:
        yield from _blocks(np.ascontiguousarray(arr))


class SsdWriter:
    """One file being written. `write_next` writes one piece (<= PIECE_BYTES) and says whether
    more remain; `commit` publishes the file atomically and hands its index entry to
    `on_commit`; `abort` removes the temp file. Write errors are reported to `on_failure`."""

    def __init__(
        self,
        identity: Identity,
        item: SpillItem,
        nsdir: Path,
        *,
        on_commit: Callable[[IndexEntry], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.identity = identity
        self.item = item
        self._on_commit = on_commit
        self._on_failure = on_failure
        name = uuid.uuid4().hex
        self.final = nsdir / f"{name}{SUFFIX}"
        self.tmp = nsdir / f".{name}{SUFFIX}{TMP_SUFFIX}"
        self._tensors: dict[str, TensorRecord] = {}
        offset = 0
        for t in item.tensors:
            self._tensors[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": t.nbytes,
                "hash": HASH_PLACEHOLDER,
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
        item = self.item
        return encode_header(
            self.identity,
            created_at=self._created_at,
            namespace=item.namespace,
            tokens=item.tokens,
            layers=item.layers,
            tensors=self._tensors,
            retain_until=item.retain_until,
        )

    def write_next(self) -> bool:
        piece = next(self._pieces, None)
        if piece is None:
            return False
        if PIECE_DELAY_S:
            time.sleep(PIECE_DELAY_S)
        i, block = piece
        try:
            self._f.write(block)
        except BaseException as e:
            self._on_failure(e)
            raise
        self._hashers[i].update(block)
        self._written[i] += len(block)
        return True

    def commit(self) -> bool:
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
            fsync_dir(self.final.parent)
            st = self.final.stat()
        except Exception as e:  # noqa: BLE001 - a failed write is a future miss
            self._on_failure(e)
            self.abort()
            return False
        self._on_commit(
            IndexEntry(
                path=self.final,
                namespace=self.item.namespace,
                ids=np.asarray(self.item.tokens, dtype=np.int64),
                nbytes=st.st_size,
                mtime=st.st_mtime,
                trimmable=self.item.trimmable,
                retain_until=self.item.retain_until,
            )
        )
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
