"""The messages between the server and an isolated engine process, and the errors they carry.

Every message is one frame (actors/frames.py) of plain data (actors/isolate/codec.py): a 4-byte
length of its JSON, the JSON, then the raw buffers of its arrays. The JSON is an object whose
first key says what it is:

  server -> engine   {"setup": {model_dir, name, options}}      the first frame, once
                     {"c": id, "m": method, "a": args, "k": kwargs}   a call (`CALLS`)
                     {"abort": row_id}                           `Worker.abort`: no answer
                     {"stop": true}                              end: no answer, the process exits 0
  engine -> server   {"hello": ModelInfo, "prompt_cache": bool, "ssd": bool}   loaded, serving
                     {"fatal": message, "usage": bool}           could not load: then it exits
                     {"r": id, "v": value}                       a call's result
                     {"r": id, "e": {"type", "message", "status"}}   the exception it raised

An exception crosses as its class name, message and HTTP status; the server raises the same class
for the few the callers tell apart (`ERRORS`), else `EngineError` with the status.
"""

from __future__ import annotations

import struct
from typing import Any

from actors.isolate.codec import decode, encode
from actors.mlx_thread import WorkerDied
from actors.worker_api import AdapterNotMounted, NotAnEmbeddingModel

# The worker calls the server may make (each a method of actors/gpu_worker.py `GpuWorker`), and the
# engine process's own: `stats` (its /stats blocks), the budget's share, the SSD tier's.
WORKER_CALLS = frozenset(
    {
        "open_row",
        "prefill",
        "prefill_group",
        "fork_rows",
        "join",
        "join_group",
        "step",
        "close_row",
        "mount_adapter",
        "unmount_adapter",
        "embed",
        "score",
        "machine",
    }
)
# The worker calls that are one job on the MLX thread whose result is the answer, unchanged
# (actors/gpu_worker.py): the engine process answers them from that thread (actors/isolate/host.py).
ROW_CALLS = frozenset({"open_row", "prefill", "prefill_group", "fork_rows", "join", "join_group", "step", "close_row"})
HOST_CALLS = frozenset({"stats", "set_other_weights", "ssd_flush", "ssd_shutdown_flush", "ssd_drain"})
CALLS = WORKER_CALLS | HOST_CALLS

_JSON_LENGTH = struct.Struct(">I")
_BLOB_LENGTH = struct.Struct(">Q")


class EngineError(RuntimeError):
    """An exception the engine process raised that the server has no class of its own for."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class EngineLost(WorkerDied):
    """The engine process died (or its socket closed) before the call's answer came: a 503, since
    the server restarts it (actors/isolate/worker.py). A WorkerDied, so the routes that catch
    that (embeddings, prompt logprobs) answer 503 as for a dead MLX thread."""

    status = 503


class EngineFailed(WorkerDied):
    """The model's engine died and could not be brought back (its restarts ran out): 503."""

    status = 503


ERRORS: dict[str, type[Exception]] = {
    "AdapterNotMounted": AdapterNotMounted,
    "NotAnEmbeddingModel": NotAnEmbeddingModel,
    "ValueError": ValueError,
    "KeyError": KeyError,
    "WorkerDied": WorkerDied,
}


def error_fields(exc: BaseException) -> dict[str, Any]:
    status = getattr(exc, "status", None)
    return {
        "type": type(exc).__name__,
        "message": str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc),
        "status": status if isinstance(status, int) else None,
    }


def raised(fields: dict[str, Any]) -> Exception:
    """The exception a call's error fields describe, to raise on the server's side."""
    kind, message, status = str(fields.get("type", "")), str(fields.get("message", "")), fields.get("status")
    cls = ERRORS.get(kind)
    if cls is not None:
        return cls(message)
    return EngineError(f"{kind}: {message}" if kind else message, status if isinstance(status, int) else None)


def message(head: dict[str, Any]) -> bytes:
    """One message's frame payload: the JSON's length, the JSON, each buffer's length and bytes."""
    text, blobs = encode(head)
    parts = [_JSON_LENGTH.pack(len(text)), text]
    for blob in blobs:
        parts += [_BLOB_LENGTH.pack(len(blob)), blob]
    return b"".join(parts)


def parse(payload: bytes) -> dict[str, Any]:
    """A frame payload back to its message (CodecError: it is not one)."""
    (size,) = _JSON_LENGTH.unpack_from(payload)
    at = _JSON_LENGTH.size + size
    text = payload[_JSON_LENGTH.size : at]
    view = memoryview(payload)
    blobs = []
    while at < len(payload):
        (n,) = _BLOB_LENGTH.unpack_from(payload, at)
        at += _BLOB_LENGTH.size
        blobs.append(bytes(view[at : at + n]))
        at += n
    return decode(text, blobs)
