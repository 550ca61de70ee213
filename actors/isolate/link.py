"""One end of the socket between the server and an isolated engine process, as a trio actor.

Inbound: frames off the stream (actors/isolate/protocol.py): a call's answer goes to the task
awaiting it; anything else to `on_message` (the engine host's calls and aborts, the server's hello).
Outbound: `post` sends a message without waiting (so `Worker.abort` never blocks): with the
socket at hand and nothing queued before it, it is written at once, from the caller (a decode
step's call then leaves before the request actors handle the last step's tokens, as a job put on
the MLX thread's queue does in one process); else it is queued and one writer task sends the queue
in order. `post_from_thread` does the same from another thread (the engine's MLX thread answers
a call the moment its job ends: actors/isolate/host.py); a lock keeps each frame whole and the
queue in order. `call` posts a call and awaits its answer.

The link closes when the other end does (EOF: its process died or exited), on a stream error, on a
message that is not plain data, or on `close` (its owner must call it: cancellation alone does
not close it); every call still waiting then raises `EngineLost` at once, never hangs. `closed`
is set and `why` says what happened.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from actors.frames import FrameBuffer, pack
from actors.isolate.codec import CodecError
from actors.isolate.protocol import EngineLost, message, parse, raised

log = logging.getLogger(__name__)

READ_BYTES = 1 << 20


def _ignore(head: dict[str, Any]) -> None:
    log.warning("unexpected message from the other process: %s", sorted(head))


class Link:
    def __init__(
        self,
        stream: trio.abc.Stream,
        on_message: Callable[[dict[str, Any]], None] = _ignore,
        *,
        sock: socket.socket | None = None,
    ) -> None:
        """`sock`: the stream's own (non-blocking) socket, for `post`'s writes at once."""
        self.stream = stream
        self._sock = sock
        self.on_message = on_message
        self.closed = trio.Event()
        self.why = ""
        self._lock = threading.Lock()  # (a frame is written, or queued, whole: posts come from two threads)
        self._queue: deque[bytes] = deque()  # what the writer has still to send, in order
        self._queued = trio.Event()  # set when a frame was queued
        self._token: trio.lowlevel.TrioToken | None = None
        self._pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._next_id = 0
        self._progress = trio.Event()
        self._scope = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the link closes; then close the stream (the other end sees EOF).
        Cancelling the task that runs it does not end it, `close` (or EOF) does: an owner being
        cancelled (shutdown) can still send its last messages (`stop`) and read the answers."""
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope(shield=True):
            try:
                with self._scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._write)
                        task_status.started()
                        await self._read()
                        nursery.cancel_scope.cancel()
            finally:
                self._close(self.why or "closed")
                try:
                    await self.stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass

    def close(self, why: str) -> None:
        """Close from this side: waiting calls raise EngineLost, the stream closes."""
        self.why = self.why or why
        self._close(self.why)
        self._scope.cancel()

    def post(self, head: dict[str, Any]) -> None:
        """Send one message, at once or through the writer (CodecError: it is not plain data).
        Never blocks; after the link has closed it is dropped."""
        failed = self._put(pack(message(head)))
        if failed:
            self.close(failed)
        elif self._queue:
            self._queued.set()

    def post_from_thread(self, head: dict[str, Any]) -> None:
        """`post`, from a thread other than the link's event loop's (once `run` has started)."""
        failed = self._put(pack(message(head)))
        if failed or self._queue:
            token = self._token
            assert token is not None
            try:
                token.run_sync_soon(self._wake, failed)
            except trio.RunFinishedError:
                pass

    def _wake(self, failed: str) -> None:
        if failed:
            self.close(failed)
        else:
            self._queued.set()

    def _put(self, frame: bytes) -> str:
        """Write `frame` at once when nothing is queued before it, else queue what is left of it;
        what went wrong with the socket, or ''."""
        with self._lock:
            if self.closed.is_set():
                return ""
            if self._sock is not None and not self._queue:  # (nothing queued or being written)
                try:
                    sent = self._sock.send(frame)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    return f"the socket failed ({exc})"
                if sent == len(frame):
                    return ""
                frame = frame[sent:]  # the rest goes through the writer, and everything after it
            self._queue.append(frame)
            return ""

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The other end's answer to `method(*args, **kwargs)`: its value, or the exception it
        raised; EngineLost when the link closes first."""
        if self.closed.is_set():
            raise EngineLost(self.why)
        call_id = self._next_id = self._next_id + 1
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._pending[call_id] = send
        try:
            self.post({"c": call_id, "m": method, "a": list(args), "k": kwargs})
            with receive:
                reply = await receive.receive()
        except trio.EndOfChannel:
            raise EngineLost(self.why) from None
        finally:
            self._pending.pop(call_id, None)
        if "e" in reply:
            raise raised(reply["e"])
        return reply.get("v")

    async def flush(self) -> None:
        """Wait until every message posted so far is written (or the link closed)."""
        while self._queue and not self.closed.is_set():
            await self._progress.wait()

    async def _read(self) -> None:
        frames = FrameBuffer()
        while True:
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.why = self.why or f"the socket failed ({exc})"
                return
            if not data:
                self.why = self.why or "the other end closed the socket"
                return
            for frame in frames.feed(data):
                try:
                    head = parse(frame)
                except (CodecError, ValueError, IndexError) as exc:
                    self.why = self.why or f"a malformed message ({exc})"
                    return
                reply_to = head.get("r")
                if reply_to is None:
                    self.on_message(head)
                elif (waiting := self._pending.pop(reply_to, None)) is not None:
                    waiting.send_nowait(head)  # (room for one: the only answer)

    async def _write(self) -> None:
        while True:
            if not self._queue:
                await self._queued.wait()
                self._queued = trio.Event()  # (a frame queued before this is seen below, one after sets it)
                continue
            try:
                await self.stream.send_all(self._queue[0])  # (it stays queued, so posts queue behind it)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.close(f"the socket failed ({exc})")
                return
            with self._lock:
                self._queue.popleft()
            self._progress.set()
            self._progress = trio.Event()

    def _close(self, why: str) -> None:
        if self.closed.is_set():
            return
        self.why = self.why or why
        self.closed.set()
        self._progress.set()
        for waiting in self._pending.values():
            waiting.close()  # its caller raises EngineLost
        self._pending.clear()
