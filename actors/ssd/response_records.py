"""The durable Responses store's files: one verified record per stored response (blocking code,
run on worker threads by actors/ssd/response_log.py).

    DIR/.lock                     flock: one server per directory
    DIR/<xx>/<response id>.json   a record (xx: the id's last two characters)
    DIR/<xx>/.<id>.json.<n>.tmp   a write in flight (a start-up reaps what a crash left)
    DIR/quarantine/               records that failed verification (the newest 16 kept)

A record is one header line, `mlx-trio-response 1 <sha256> <body length> <expires_at>`, then
the body: the JSON object {id, created_at, expires_at (epoch seconds), input, output,
instructions, response}; the hash covers the expiry and the body. Every record is verified when
the directory opens (a start-up reads and hashes them all, without parsing their JSON) and in
full when it is read: the header, the length, the hash, the JSON and its fields, the expiry
against the header's, and the id against the file's name. One that fails is never served: it
is logged, moved to quarantine and answered as absent. Writes go to a temp file, are fsync'd,
renamed into place, and each touched directory is fsync'd once per batch, so a kill leaves a
record whole or absent.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger(__name__)

MAGIC = "mlx-trio-response"
VERSION = 1
SUFFIX = ".json"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_HEADER = re.compile(rf"{MAGIC} (\d+) ([0-9a-f]{{64}}) (\d+) ([0-9.e+]+)")
_TMP_COUNTER = itertools.count()


class RecordCorrupt(Exception):
    """A record failed verification: it is never served."""


class StoreUnavailable(Exception):
    """The directory cannot be used (not writable, or another server holds it)."""


@attrs.define(eq=False)
class RecordMeta:
    """What the index keeps of a record on disk."""

    id: str
    path: Path
    nbytes: int
    expires_at: float  # epoch seconds
    last_used: float  # epoch seconds: its write, or its last read (LRU under the size cap)


def _digest(expires: str, body: bytes) -> str:
    h = hashlib.sha256(expires.encode())
    h.update(b"\n")
    h.update(body)
    return h.hexdigest()


def encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    expires = repr(float(record["expires_at"]))
    return f"{MAGIC} {VERSION} {_digest(expires, body)} {len(body)} {expires}\n".encode() + body


def verified_expiry(data: bytes) -> float:
    """The expiry of the record in `data`, once its header, length and hash hold (the body is
    not parsed: the start-up scan). Raises RecordCorrupt."""
    head, newline, body = data.partition(b"\n")
    match = _HEADER.fullmatch(head.decode("ascii", "replace"))
    if not newline or match is None:
        raise RecordCorrupt("not a response record header")
    if int(match.group(1)) != VERSION:
        raise RecordCorrupt(f"record version {match.group(1)}")
    if int(match.group(3)) != len(body):
        raise RecordCorrupt(f"body is {len(body)} bytes, the header says {match.group(3)}")
    if _digest(match.group(4), body) != match.group(2):
        raise RecordCorrupt("hash mismatch")
    try:
        return float(match.group(4))
    except ValueError:
        raise RecordCorrupt("unreadable expiry") from None


def decode(data: bytes, expect_id: str) -> dict[str, Any]:
    """The verified record in `data` (a file named after `expect_id`). Raises RecordCorrupt."""
    expires = verified_expiry(data)
    body = data.partition(b"\n")[2]
    try:
        record = json.loads(body)
    except ValueError as e:
        raise RecordCorrupt(f"body is not JSON: {e}") from None
    if (
        not isinstance(record, dict)
        or record.get("id") != expect_id
        or record.get("expires_at") != expires
        or not isinstance(record.get("input"), list)
        or not isinstance(record.get("output"), list)
        or not isinstance(record.get("response"), dict)
        or not isinstance(record.get("instructions"), (str, type(None)))
    ):
        raise RecordCorrupt("record fields missing or of the wrong type")
    return record


class RecordDir:
    """The directory, opened: its lock held. Every method blocks (run them on a thread)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._lock_fd: int | None = None
        self.reaped_temp = 0
        self.quarantined = 0

    def open(self, now: float) -> list[RecordMeta]:
        """Take the lock, reap temp files, verify every record; the live ones' metadata (expired
        records are removed, corrupt ones quarantined with a log line)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreUnavailable(f"cannot open the response store {self.root}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreUnavailable(f"the response store {self.root} is in use by another server") from None
            raise StoreUnavailable(f"cannot lock the response store {self.root}: {e}") from None
        self._lock_fd = fd
        found: list[RecordMeta] = []
        for shard in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != QUARANTINE):
            for path in sorted(shard.iterdir()):
                if path.name.endswith(TMP_SUFFIX):
                    path.unlink(missing_ok=True)
                    self.reaped_temp += 1
                elif path.name.endswith(SUFFIX):
                    meta = self._scanned(path, now)
                    if meta is not None:
                        found.append(meta)
        return found

    def _scanned(self, path: Path, now: float) -> RecordMeta | None:
        rid = path.name[: -len(SUFFIX)]
        try:
            if not _ID.fullmatch(rid):
                raise RecordCorrupt("not a response id")
            data = path.read_bytes()
            expires = verified_expiry(data)
        except (OSError, RecordCorrupt) as e:
            self.quarantine(path, str(e))
            return None
        if expires <= now:
            path.unlink(missing_ok=True)
            return None
        return RecordMeta(rid, path, len(data), expires, path.stat().st_mtime)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def path_of(self, rid: str) -> Path:
        if not _ID.fullmatch(rid):
            raise ValueError(f"not a response id: {rid!r}")
        return self.root / rid[-2:] / f"{rid}{SUFFIX}"

    def write(self, records: list[dict[str, Any]], now: float) -> list[RecordMeta | Exception]:
        """Write a batch: each record to its temp file and fsync'd, then renamed into place, then
        each directory touched fsync'd once. A record that fails is that record's exception."""
        staged: list[tuple[Path, Path, int] | Exception] = []
        for record in records:
            try:
                path = self.path_of(record["id"])
                path.parent.mkdir(exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}-{next(_TMP_COUNTER)}{TMP_SUFFIX}")
                data = encode(record)
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                staged.append((tmp, path, len(data)))
            except Exception as e:  # noqa: BLE001 - this record is not durable; the others may be
                staged.append(e)
        out: list[RecordMeta | Exception] = []
        dirs: set[Path] = set()
        for record, step in zip(records, staged):
            if isinstance(step, Exception):
                out.append(step)
                continue
            tmp, path, nbytes = step
            try:
                os.replace(tmp, path)
                dirs.add(path.parent)
                out.append(RecordMeta(record["id"], path, nbytes, float(record["expires_at"]), now))
            except OSError as e:
                tmp.unlink(missing_ok=True)
                out.append(e)
        failed = self._fsync_dirs(dirs | {self.root})
        if failed is not None:  # the renames may not survive a crash: say so for every one
            out = [failed if isinstance(m, RecordMeta) else m for m in out]
        return out

    def remove(self, paths: list[Path]) -> None:
        dirs = set()
        for path in paths:
            try:
                path.unlink()
                dirs.add(path.parent)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("response store: cannot remove %s: %s", path, e)
        self._fsync_dirs(dirs)

    def read(self, meta: RecordMeta) -> dict[str, Any]:
        """The verified record; raises RecordCorrupt (or OSError) on any doubt."""
        return decode(meta.path.read_bytes(), meta.id)

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a record that failed verification aside (logged; the newest QUARANTINE_KEEP kept)."""
        log.warning("response store: skipped a corrupt record %s (%s); it is answered as not found", path.name, reason)
        qdir = self.root / QUARANTINE
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / f"{int(time.time())}-{path.name}")
            self.quarantined += 1
            for old in sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime)[:-QUARANTINE_KEEP]:
                old.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        except OSError:
            path.unlink(missing_ok=True)

    @staticmethod
    def _fsync_dirs(dirs: set[Path]) -> OSError | None:
        failed = None
        for directory in dirs:
            try:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                failed = e
        return failed


def dir_problem(root: Path) -> str | None:
    """Why records could not be kept under `root`, or None (a probe file is written and removed)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}{TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"--response-store {root} is not a writable directory ({exc.strerror or exc})"
    return None
