"""The control channel between rank 0 (the server) and its tensor-parallel followers.

Each follower is a child process of the server; its stdin carries rank 0's messages and its stdout
carries the follower's acknowledgements, one pickle per frame (actors/frames.py). The tensors never
travel here: every forward's collectives run over `mx.distributed` (the ring backend). The control
messages use the pipe because it ties the processes' lives together for free: a follower whose
parent dies reads EOF and exits, and rank 0 sees a dead follower as EOF instead of waiting in a
collective for a call description that will never come. The pipe only links local children:
followers on other hosts are not implemented (docs/operations.md).

Pickle is safe here: both ends are this program, over an anonymous pipe between parent and child.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import attrs

from actors.frames import read_frame, write_frame
from model.engine.rows import PrefillProgress, RowOpened, TokenOut
from model.options import EngineOptions, KVOptions

# The engine methods rank 0 runs and every follower repeats, in the same order.
BROADCAST = frozenset(
    {"open_row", "prefill", "prefill_group", "fork_rows", "join", "join_group", "step", "close_row", "warm_up"}
)


@attrs.frozen
class Setup:
    """What a follower needs to build the same engine on its shard (the first message)."""

    model_dir: str
    engine_options: EngineOptions
    eos_token_ids: frozenset[int]
    protected_ids: frozenset[int]
    kv: KVOptions


@attrs.frozen
class Call:
    method: str  # one of BROADCAST
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@attrs.frozen
class Stop:
    """Rank 0 is shutting down: the follower exits 0."""


@attrs.frozen
class Ack:
    """A follower's answer: `ready` after set-up, else the digest of one call's result (or the
    error it raised), which rank 0 compares with its own to catch ranks drifting apart."""

    ok: bool
    value: Any = None  # ready: the rank's KV bytes per token; a call: `digest(result)`
    error: str = ""


def send(stream: IO[bytes], message: Any) -> None:
    write_frame(stream, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(stream: IO[bytes]) -> Any:
    """The next message; EOFError when the other end closed."""
    return pickle.loads(read_frame(stream))


def digest(result: Any) -> Any:
    """What must agree across ranks: row ids, token ids, finish reasons, progress counts. (Logprobs
    are left out: equal logits give equal tokens; a last-bit difference there is no drift.)"""
    if isinstance(result, list):
        return [digest(r) for r in result]
    if isinstance(result, TokenOut):
        return (result.row_id, result.token, result.finish)
    if isinstance(result, (RowOpened, PrefillProgress)):
        return attrs.astuple(result)
    return None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
