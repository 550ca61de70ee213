"""`python -m actors.serve` as a subprocess: wait until it serves (shared by the e2e signal tests)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
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
