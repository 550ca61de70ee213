"""Decoding a request's images: on threads of their own, under a memory bill.

Decoding and resizing a large image takes seconds of CPU and hundreds of MB. On api/http/offload.py's
threads, which every request's parsing and templating share, a few image requests would make a
plain chat wait behind them; so image decoding runs on its own `THREADS`, behind its own
limiter, and the shared threads only ever read image headers (microseconds).

Memory: a request is billed what decoding its images takes at most (`images.request_bytes`,
from the headers alone), from before its first decode until its row opens or it fails (its
patches travel with it until then). A request whose bill is over the per-request cap
(`--media-request-memory`) is a 400. The others hold their bills out of the total
(`--media-memory`) in arrival order: one that does not fit waits until earlier ones release
theirs; it is never refused for arriving alongside others. The per-request cap is at most the
total, so every admitted bill fits once the ledger drains.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from actors.handles import ServerHandles
from api import images
from api.errors import bad_request
from api.images import ImagePart, ImagePlan
from model.engine.rows import ImageInput
from model.options import AdmissionOptions

THREADS = 2  # images decode two at a time: each is CPU-bound and the cores are shared with the MLX thread
GIB = 1 << 30
_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("api_media_limiter")
_ledgers: weakref.WeakKeyDictionary[ServerHandles, MediaMemory] = weakref.WeakKeyDictionary()


def limiter() -> trio.CapacityLimiter:
    """The media limiter of the running trio loop (one per `trio.run`, made on first use)."""
    try:
        return _LIMITER.get()
    except LookupError:
        made = trio.CapacityLimiter(THREADS)
        _LIMITER.set(made)
        return made


@attrs.define(eq=False)
class _Waiter:
    nbytes: int
    granted: trio.Event = attrs.Factory(trio.Event)


class MediaMemory:
    """A byte ledger, first come first served (trio thread only): `hold(n)` waits until `n` bytes
    fit beside those held and every earlier waiter has its bytes, so a large bill is never
    overtaken forever by small ones."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """`nbytes` held for the block (at most `capacity`: a larger bill could never be served)."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"a bill of {nbytes} bytes cannot fit a ledger of {self.capacity}")
        await self._acquire(nbytes)
        try:
            yield
        finally:
            self._release(nbytes)

    async def _acquire(self, nbytes: int) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._queue and self.used + nbytes <= self.capacity:
            self.used += nbytes
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        waiter = _Waiter(nbytes)
        self._queue.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():  # granted as it was cancelled: give the bytes back
                self._release(nbytes)
            else:  # leaving the queue may let the ones behind it in
                self._queue.remove(waiter)
                self._grant()
            raise

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.used + self._queue[0].nbytes <= self.capacity:
            waiter = self._queue.popleft()
            self.used += waiter.nbytes
            waiter.granted.set()


def total_bytes(options: AdmissionOptions) -> int:
    return int(options.media_memory_gb * GIB)


def request_limit(options: AdmissionOptions) -> int:
    """The most one request may be billed: its own cap, never more than the total."""
    return min(int(options.media_request_memory_gb * GIB), total_bytes(options))


def memory(handles: ServerHandles) -> MediaMemory:
    """The server's media ledger (one per server, made on first use)."""
    ledger = _ledgers.get(handles)
    if ledger is None:
        ledger = _ledgers[handles] = MediaMemory(total_bytes(handles.options.admission))
    return ledger


@asynccontextmanager
async def decoded(
    handles: ServerHandles, parts: Sequence[ImagePart], plans: Sequence[ImagePlan]
) -> AsyncIterator[tuple[ImageInput, ...]]:
    """`parts` (planned by `images.plan_images`) decoded on the media threads and billed until
    the block ends; no parts, no bill. Raises ApiError: a bill over the per-request cap, or an
    image that does not decode."""
    if not parts:
        yield ()
        return
    nbytes = images.request_bytes(plans)
    limit = request_limit(handles.options.admission)
    if nbytes > limit:
        raise bad_request(
            f"decoding these {len(parts)} images, videos or clips takes up to {_mib(nbytes)} MiB of memory, "
            f"over this server's limit of {_mib(limit)} MiB per request; send fewer or smaller ones",
            param=parts[0].param,
            code="images_too_large",
        )
    async with memory(handles).hold(nbytes):
        decode = functools.partial(images.prepare_images, parts, plans, handles.info)
        yield await trio.to_thread.run_sync(decode, limiter=limiter())


def _mib(nbytes: int) -> int:
    return -(-nbytes // (1 << 20))
