"""The isolated engine process (`--isolate`): one model's GPU worker, started by the server.

The server (actors/isolate/process.py) starts it with one end of a socket pair as an inherited
file descriptor, its number the only argument. The first frame is the setup (the model
directory, its name, the server's options): the BLAS is bound before MLX loads, as in the server,
then the GPU worker (actors/gpu_worker.py) loads the model and actors/isolate/host.py serves the
server's calls until it says `stop` (exit 0) or its socket closes (exit 1: the server died, even
by kill -9; then the process is gone within `LOST_EXIT_S` whatever the MLX thread is doing).

Its life is the server's: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or systemd's
SIGTERM to the whole service, reaches every process of the group; the server decides when the
engine stops). Its logs go to the server's stderr, each line naming the model.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from typing import IO, cast

log = logging.getLogger("actors.isolate.child")

LOST_EXIT_S = 3.0  # after the server's end closed: exit even if a job is still running


def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    from actors.frames import read_frame
    from actors.isolate.protocol import parse

    try:
        # Unbuffered: a buffered read could take bytes of the frames after it from the socket.
        with cast(IO[bytes], sock.makefile("rb", buffering=0)) as stream:
            setup = parse(read_frame(stream))["setup"]  # (decodes only the options: no MLX yet)
    except (EOFError, OSError, KeyError, ValueError) as exc:
        sys.stderr.write(f"engine process: no setup from the server ({exc})\n")
        return 1
    options, model_dir, name = setup["options"], setup["model_dir"], setup["name"]
    level = logging.getLevelName(options.observability.log_level.upper())
    label = name or os.path.basename(model_dir)
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [engine {label}] %(name)s: %(message)s")
    from model.load.blas import preload_optimized_blas

    blas = preload_optimized_blas(options.engine.blas)  # (before anything imports MLX)
    log.debug(blas.log_line())
    import trio

    from actors.gpu_worker import GpuWorker
    from actors.isolate.host import serve_engine

    worker = GpuWorker(model_dir, options, name=name)

    def lost() -> None:
        # The server is gone: a long job (a model load, a prefill) must not keep us alive.
        timer = threading.Timer(LOST_EXIT_S, _exit_now, (1,))
        timer.daemon = True
        timer.start()

    async def serve() -> int:
        sock.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        return await serve_engine(stream, worker, options, on_lost=lost, sock=sock)

    code = trio.run(serve)
    logging.shutdown()
    return code


def _exit_now(code: int) -> None:
    log.error("the engine did not stop within %.0f s of losing the server: exiting now", LOST_EXIT_S)
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
