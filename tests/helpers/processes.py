"""A real `python -m actors.serve` on a unix socket or a TCP port, and the processes it starts
(the --unix and --isolate e2e tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m actors.serve ARGS` with its combined output collected in `lines`."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.serve", "--warm-up", "off", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or ()), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, text: str, limit_s: float = 60.0) -> None:
        deadline = time.monotonic() + limit_s
        while text not in self.log:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"no {text!r} in the server's log:\n{self.log[-6000:]}")
            time.sleep(0.05)

    def wait_healthy(self, client: httpx.Client, limit_s: float = 120.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if client.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"the server did not become healthy:\n{self.log[-6000:]}")

    def interrupt(self, limit_s: float = 60.0) -> int:
        """SIGINT, then its exit code (killed after `limit_s`)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=limit_s)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)


def unix_client(path: Path, timeout: float = 60.0) -> httpx.Client:
    """An httpx client whose requests go over the unix socket at `path`."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=timeout)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
