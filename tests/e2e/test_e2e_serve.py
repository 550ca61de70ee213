"""End to end: `python -m actors.serve` as a subprocess, streamed with the openai SDK, SIGINT
mid-stream; the stream must be cut by the shutdown deadline with a clean final chunk, and the
process exit 0 within the shutdown timeout, with no traceback in its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (ROOT / "actors" / "gpu_worker.py").exists(), reason="needs the real GPU worker (actors/gpu_worker.py)"
)

SHUTDOWN_TIMEOUT = 1.5
MAX_TOKENS = 60_000  # far more than the tiny model generates before the deadline


def test_sigint_mid_stream_ends_the_stream_cleanly_and_exits_0(tiny_model_factory):
    """The demo model answers 13 scripted tokens and then EOS, so its stream is over within
    milliseconds: a SIGINT "mid-stream" would land after a natural finish and prove nothing. A
    tiny random-weight model (its EOS rows are shrunk, so it does not end early) with room for far
    more tokens than it can generate before the deadline keeps the stream running until the
    shutdown cut-off ends it."""
    openai = pytest.importorskip("openai")
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=1 << 16)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--prompt-cache",
            "0",
            "--served-model-name",
            "tiny",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_healthy(base, proc)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        finish_reasons, chunks, after_signal, usage = [], 0, 0, None
        signalled_at = ended_at = None
        for chunk in stream:  # the SDK raises on a cut stream and stops at [DONE]
            chunks += 1
            if signalled_at is not None:
                after_signal += 1
            if chunks == 3:
                os.kill(proc.pid, signal.SIGINT)
                signalled_at = time.monotonic()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish_reasons.append(chunk.choices[0].finish_reason)
                ended_at = time.monotonic()
            if not chunk.choices:
                usage = chunk.usage  # include_usage: the last chunk
        # The signal landed while tokens were flowing, and the shutdown deadline (not EOS, not
        # max_tokens) ended the stream: a clean final chunk with finish_reason "abort" (which the
        # SDK takes, as it takes vLLM's).
        assert signalled_at is not None and after_signal > 10
        assert finish_reasons == ["abort"]
        assert usage is not None and 3 <= usage.completion_tokens < MAX_TOKENS
        assert SHUTDOWN_TIMEOUT - 0.5 <= ended_at - signalled_at <= SHUTDOWN_TIMEOUT + 2.0
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT + 5) == 0
        reader.join(timeout=5)
        log = "".join(output)
        assert "Traceback" not in log, log
        assert "SIGINT" in log and "bye" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
