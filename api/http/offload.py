"""Per-request work too slow for the event loop, run on worker threads.

JSON parsing of large bodies, translation, chat templating and tokenization, the stable-prefix
probe, token counting and grammar compilation each can take from milliseconds to seconds on a
large or hostile body; on the trio thread that time stalls every running stream and /health.
One `CapacityLimiter` bounds how many such calls run at once, so a burst of huge bodies queues
here instead of piling threads onto the cores the MLX thread and the event loop need. Image
decoding has threads and a limiter of its own (api/media.py), so it never holds these.

`run` keeps the work of a small body inline: templating and tokenizing `INLINE_BYTES` of text
takes about a millisecond, while the hop to a thread and back costs about 0.1 ms and a wake-up
of the loop. `to_thread` always hops (grammar compilation, whose cost does not follow the body's
size). A cancelled caller (the client went away) still waits for its thread: the work is
bounded, and abandoning it would leave a thread running outside the limiter's count.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import trio

P = ParamSpec("P")
T = TypeVar("T")

THREADS = 4  # a few requests prepare in parallel; more would only contend for the GIL and cores
INLINE_BYTES = 4 << 10
_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("api_offload_limiter")
_body_bytes: contextvars.ContextVar[int | None] = contextvars.ContextVar("api_offload_body_bytes", default=None)


def limiter() -> trio.CapacityLimiter:
    """The shared limiter of the running trio loop (one per `trio.run`, made on first use)."""
    try:
        return _LIMITER.get()
    except LookupError:
        made = trio.CapacityLimiter(THREADS)
        _LIMITER.set(made)
        return made


def note_body(size: int) -> None:
    """The size of the request body being handled (set where the body is parsed)."""
    _body_bytes.set(size)


async def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)`, inline when it works on a body of at most `INLINE_BYTES`, else
    on a worker thread (`to_thread`)."""
    size = _body_bytes.get()
    if size is not None and size <= INLINE_BYTES:
        return fn(*args, **kwargs)
    return await to_thread(fn, *args, **kwargs)


async def to_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on a worker thread, with the caller's context variables; its
    exceptions are raised here."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=limiter())
