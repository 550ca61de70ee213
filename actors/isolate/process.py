"""Starting an isolated engine process, and saying how one ended.

`spawn_engine` makes a socket pair, starts `actors.isolate.child` with one end inherited as a file
descriptor (nothing else can connect to it: there is no path) and keeps the other. The child runs
in the server's working directory, so relative paths in the flags name the same files, with the
server's own package directory first on its import path, so a module in that directory never
shadows ours. A test hands `IsolatedWorker` a launcher of its own instead (an engine in the same
process, on a memory stream): it meets `EngineProcess`.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import trio

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding our packages
_BOOT = "import sys; sys.path.insert(0, {root!r}); from actors.isolate.child import main; sys.exit(main())"


class EngineProcess(Protocol):
    """A started engine: the server's end of its socket, and its life."""

    stream: trio.abc.Stream
    sock: socket.socket | None  # the stream's socket, when it is one
    pid: int | None

    async def wait(self) -> int:
        """Its exit status once it has exited (negative: the signal that ended it)."""
        ...

    def kill(self) -> None: ...


Launch = Callable[[], Awaitable[EngineProcess]]


class SpawnedEngine:
    def __init__(self, process: trio.Process, stream: trio.abc.Stream, sock: socket.socket) -> None:
        self.process = process
        self.stream = stream
        self.sock: socket.socket | None = sock  # (the stream's own: the link writes small frames at once)
        self.pid: int | None = process.pid

    async def wait(self) -> int:
        return await self.process.wait()

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


async def spawn_engine() -> SpawnedEngine:
    """A new engine process, its socket connected (it waits for its setup)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd = theirs.fileno()
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", _BOOT.format(root=str(_ROOT)), str(fd)], pass_fds=(fd,)
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()  # (the child holds its own copy: our closing it leaves the child's end alone)
    ours.setblocking(False)
    return SpawnedEngine(process, trio.SocketStream(trio.socket.from_stdlib_socket(ours)), ours)


def describe_exit(code: int | None) -> str:
    """An exit status as the log says it: "exit status 1", "killed by SIGKILL"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
