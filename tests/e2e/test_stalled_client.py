"""A client that stops reading must not hold the process past the shutdown deadline.

Real sockets, real hypercorn, real signals: `python -m actors.serve`'s `main()` in a subprocess,
with the model plan swapped for a FakeWorker (no MLX) that streams tokens as fast as it can. The
client shrinks its receive buffer, asks for a huge stream and never reads, so hypercorn's
shielded `send_all` blocks and no cancel can free the connection. After
SIGINT the process must still be gone by the shutdown plan's watchdog deadline (`--shutdown-timeout`
+ the HTTP grace + the watchdog slack): the watchdog's `os._exit(1)` is the only way out, and it
is taken.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from actors.shutdown import ShutdownPlan

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 1.0
WATCHDOG_SLACK_S = 1.0
STARTUP_LIMIT_S = 60.0
PLAN = ShutdownPlan(drain=SHUTDOWN_TIMEOUT_S, watchdog_slack=WATCHDOG_SLACK_S)

SERVER = textwrap.dedent(
    """
    import sys
    import attrs
    import actors.serve as serve
    from actors.shutdown import ShutdownPlan
    from tests.fakes import FakeTokenizer, FakeWorker

    planned = ShutdownPlan.for_options
    ShutdownPlan.for_options = classmethod(  # a short watchdog slack, so the test is quick
        lambda cls, options: attrs.evolve(planned(options), watchdog_slack=float(sys.argv[1]))
    )

    def plan(config):
        worker = FakeWorker(prefill_cost=0.0, join_cost=0.0, step_cost=0.0)
        worker.info = attrs.evolve(worker.info, context_length=10**7)  # room for an endless stream
        return None, worker, lambda info: FakeTokenizer()

    serve._load_plan = plan
    sys.exit(serve.main(sys.argv[2:]))
    """
)


def start_server(log_path: Path) -> tuple[subprocess.Popen, int]:
    """The server's stderr goes to a file (a pipe nobody drains could block its logging)."""
    args = [
        sys.executable,
        "-c",
        SERVER,
        str(WATCHDOG_SLACK_S),
        "--port",
        "0",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--prompt-cache",
        "0",
    ]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            args, cwd=ROOT, stderr=log_file, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"Running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if match:
            return proc, int(match.group(1))
        time.sleep(0.05)
    proc.kill()
    pytest.fail("server did not start:\n" + log_path.read_text())


def open_stream(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a tiny window
    sock.connect(("127.0.0.1", port))
    body = b'{"prompt": "stall", "max_tokens": 5000000, "stream": true}'
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.slow
def test_a_client_that_stops_reading_does_not_block_exit_past_the_deadline(tmp_path):
    log_path = tmp_path / "server.log"
    proc, port = start_server(log_path)
    sock = open_stream(port)  # ... and never read from it
    try:
        time.sleep(3.0)  # the stream fills the socket buffers, then hypercorn's write blocks
        assert proc.poll() is None
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        budget = PLAN.watchdog
        try:
            proc.wait(timeout=budget + 10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running {budget + 10.0:.0f} s after SIGINT")
        took = time.monotonic() - signalled
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert took <= budget + 3.0, log  # the watchdog's budget, plus process teardown
    # The stalled write pinned the connection, so the watchdog is what ended the process.
    assert proc.returncode == 1 and "shutdown overran" in log, log


def test_a_reading_client_gets_a_clean_end_and_exit_0(tmp_path):
    """The contrast: the same endless stream, read to its end, is cut cleanly at the deadline."""
    log_path = tmp_path / "server.log"
    proc, port = start_server(log_path)
    sock = open_stream(port)
    received = bytearray()

    def read_all() -> None:
        while chunk := sock.recv(1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=PLAN.watchdog + 10.0)
        reader.join(timeout=5.0)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log_path.read_text()
    assert b"data: [DONE]" in received[-200:]  # a final chunk, then the chunked terminator
