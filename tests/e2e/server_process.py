"""`python -m actors.serve` as a subprocess: wait until it serves (shared by the e2e signal tests)."""

from __future__ import annotations

import os
import re
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


def launch_quick(args: list[str], log_path: Path) -> subprocess.Popen:
    """`python -m actors.serve` on a free port without warm-up, its log in `log_path`."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.serve", "--port", "0", "--warm-up", "off", *args],
            cwd=ROOT,
            stderr=log_file,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )


def end(proc: subprocess.Popen) -> int:
    """SIGINT, then its exit code (killed after 30 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def wait_until_serving(proc: subprocess.Popen, log_path: Path, limit_s: float) -> str:
    """The server's base URL once /health says ok (503 "loading" until the model is in); kills
    the process and fails the test when it does not get there within `limit_s`."""
    deadline = time.monotonic() + limit_s
    base = None
    while time.monotonic() < deadline and proc.poll() is None:
        if base is None:
            match = re.search(r"Running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
            base = f"http://127.0.0.1:{match.group(1)}" if match else None
        elif httpx.get(f"{base}/health", timeout=5).status_code == 200:
            return base
        time.sleep(0.05)
    proc.kill()
    pytest.fail("server did not start:\n" + log_path.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).content == b'{"status": "ok"}':
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became healthy")


SHUTDOWN_TIMEOUT = 10


# `actors.serve.main` with every SSD piece write slowed down first (cache.ssd_writer imports no
# MLX, so the server still binds its BLAS before MLX loads).
_SLOW_WRITES_SERVE = (
    "import sys; import cache.ssd_writer as writer; writer.PIECE_DELAY_S = {delay!r}; "
    "from actors.serve import main; sys.exit(main(sys.argv[1:]))"
)


class Server:
    """One `python -m actors.serve` subprocess on a free port; output collected in `log`.
    `piece_delay_s` > 0 sleeps that long before every SSD piece write (the crash test's kills
    then land mid-file)."""

    def __init__(self, model_dir: Path, *args: str, piece_delay_s: float = 0.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        launcher = (
            ["-c", _SLOW_WRITES_SERVE.format(delay=float(piece_delay_s))] if piece_delay_s else ["-m", "actors.serve"]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "--model",
                str(model_dir),
                "--port",
                str(self.port),
                "--shutdown-timeout",
                str(SHUTDOWN_TIMEOUT),
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.client = httpx.Client(base_url=self.base, timeout=60)
        try:
            wait_healthy(self.base, self.proc, deadline_s=60)
        except AssertionError as e:
            self.kill()
            raise AssertionError(f"{e}; server log:\n{self.log[-4000:]}") from None
        except BaseException:
            self.kill()
            raise

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def chat(self, messages: list[dict], max_tokens: int = 8) -> dict:
        r = self.client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str, max_tokens: int = 6) -> dict:
        r = self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        return self.client.get("/stats").json()

    def stop(self) -> int:
        """Ctrl-C, then the exit code."""
        self.client.close()  # an idle keep-alive connection would hold hypercorn's graceful drain
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=SHUTDOWN_TIMEOUT * 2 + 20)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.client.close()
        self._reader.join(timeout=5)
