"""End to end: `python -m actors.serve` as a subprocess, streamed with the openai SDK, SIGINT
mid-stream; the stream must end cleanly and the process exit 0 within the shutdown timeout."""

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

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not (ROOT / "actors" / "gpu_worker.py").exists(), reason="needs the real GPU worker (actors/gpu_worker.py)"
)

SHUTDOWN_TIMEOUT = 3


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


def test_sigint_mid_stream_ends_the_stream_cleanly_and_exits_0():
    openai = pytest.importorskip("openai")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.serve", "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_healthy(base, proc)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=100_000, stream=True,
        )
        finish_reasons, chunks = [], 0
        for chunk in stream:  # the SDK raises on a cut stream and stops at [DONE]
            chunks += 1
            if chunks == 3:
                os.kill(proc.pid, signal.SIGINT)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish_reasons.append(chunk.choices[0].finish_reason)
        assert chunks >= 3 and len(finish_reasons) == 1
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT + 15) == 0
        reader.join(timeout=5)
        log = "".join(output)
        assert "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
