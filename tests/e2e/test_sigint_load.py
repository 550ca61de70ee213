"""Ctrl-C under load: `python -m actors.serve` as a subprocess with a tiny random-weight model,
`--batch 8 --shutdown-timeout 3 --ssd-cache DIR`, and 32 streams in flight (8 decoding, 24
admitted and waiting in the scheduler's queue: no status line sent yet).

* One SIGINT: the 24 queued streams get 503 + Retry-After at once; every decoding stream ends
  cleanly — its final chunk (finish_reason "abort": the shutdown deadline cut it) and then
  `data: [DONE]` — about `--shutdown-timeout` after the signal; the durability flush runs and is
  reported (`shutdown flush: durable (...)`, the prompt-cache entry written before the streams
  is on disk); the process exits 0 well within the watchdog's budget, with no traceback in its log.
* Two SIGINTs in a row: the second one exits at once (within ~3 s) with 130, and no client is
  left hanging.

A client that stops reading is tests/test_stalled_client.py (the watchdog's hard exit).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import httpx
import pytest

from actors.shutdown import ShutdownPlan
from tests.e2e.server_process import wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 32
SHUTDOWN_TIMEOUT_S = 3.0
STARTUP_LIMIT_S = 120.0
MAX_TOKENS = 50_000  # far more than the tiny model produces before the deadline

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    # Room for far more tokens than are generated before the deadline (as in test_e2e_serve).
    return tiny_model_factory("qwen3", max_position_embeddings=1 << 16)


def start_server(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """The server's stderr goes to a file (a pipe nobody drains could block its logging)."""
    log_path = tmp_path / "server.log"
    args = [
        sys.executable,
        "-m",
        "actors.serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--batch",
        "8",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--ssd-cache",
        str(tmp_path / "ssd"),
    ]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            args, cwd=ROOT, stderr=log_file, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    return proc, wait_until_serving(proc, log_path, STARTUP_LIMIT_S), log_path


@attrs.define
class Stream:
    index: int
    status: int | None = None
    retry_after: str | None = None
    error_code: str | None = None  # a refused stream's error code
    chunks: int = 0  # JSON chunks with choices
    finish_reasons: list[str] = attrs.Factory(list)
    done: bool = False  # saw data: [DONE]
    after_done: int = 0  # frames after [DONE] (must be none)
    ended_at: float | None = None  # the body's end (or the connection's)
    error: str | None = None


def run_stream(base: str, stream: Stream) -> None:
    body = {"prompt": f"Stream {stream.index}: once upon a time", "max_tokens": MAX_TOKENS, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            stream.status = response.status_code
            if response.status_code != 200:
                stream.retry_after = response.headers.get("retry-after")
                stream.error_code = json.loads(response.read())["error"]["code"]
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if stream.done:
                    stream.after_done += 1
                elif payload == "[DONE]":
                    stream.done = True
                else:
                    chunk = json.loads(payload)
                    assert "error" not in chunk, chunk
                    stream.chunks += 1
                    reason = chunk["choices"][0].get("finish_reason")
                    if reason is not None:
                        stream.finish_reasons.append(reason)
    except Exception as exc:  # recorded, checked by the test (a cut connection is an error here)
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended_at = time.monotonic()


def start_streams(base: str) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream(i) for i in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(base, s), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return streams, threads


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def log_tail(log: str, lines: int = 40) -> str:
    """The log without its per-request lines (32 of them), last `lines` lines: for failures."""
    kept = [line for line in log.splitlines() if "mlx_trio.requests" not in line]
    return "\n".join(kept[-lines:])


def check_exit(code: int, log: str, allowed: tuple[int, ...]) -> None:
    if code == -signal.SIGABRT and "terminate called without an active exception" in log:
        pytest.fail(
            "the process aborted at interpreter exit (SIGABRT, 'terminate called without an active "
            "exception'): MLX streams of the GPU-worker thread were not destroyed before it ended "
            "(mx.clear_streams() at the end of actors/gpu_worker.py's thread)\n" + log_tail(log)
        )
    assert code in allowed, (code, log_tail(log))


def all_admitted(base: str, streams: list[Stream]) -> bool:
    """8 streams decoding and the rest queued behind them."""
    if sum(s.chunks > 0 for s in streams) < 8:
        return False
    batch = stats(base)["batch"]
    return batch["active_rows"] + batch["pending_rows"] == len(streams)


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=10).json()


@pytest.mark.slow
def test_sigint_with_32_streams_in_flight_ends_every_stream_and_exits_0(model_dir, tmp_path):
    proc, base, log_path = start_server(model_dir, tmp_path)
    try:
        # One chat turn to its end first: its prompt-cache entry is what the shutdown flush
        # must make durable (the busy engine keeps the write-behind from running before).
        warm = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "remember this " * 40}], "max_tokens": 4},
        )
        assert warm.status_code == 200, warm.text
        streams, threads = start_streams(base)
        # All 32 admitted, 8 of them decoding (200 and headers sent), 24 queued behind them.
        wait_for(lambda: all_admitted(base, streams), 60, "32 streams admitted and 8 decoding")
        batch = stats(base)["batch"]
        assert batch["active_rows"] == 8 and batch["pending_rows"] == STREAMS - 8, batch
        assert sum(s.status is None for s in streams) == STREAMS - 8  # the queued ones: no status yet
        chunks_before = {s.index: s.chunks for s in streams}
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        budget = ShutdownPlan(drain=SHUTDOWN_TIMEOUT_S).http_deadline + 10.0
        try:
            code = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {budget:.0f} s after SIGINT:\n" + log_tail(log_path.read_text()))
        exited_s = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    check_exit(code, log, (0,))
    assert "Traceback" not in log, log_tail(log)
    assert "SIGINT: shutting down gracefully" in log and "bye" in log, log_tail(log)
    # Every decoding stream ended cleanly: 200, a final chunk cut by the deadline, then [DONE],
    # nothing after; every queued one was refused at once with 503 + Retry-After.
    decoding = [s for s in streams if chunks_before[s.index] > 0]
    for s in decoding:
        assert s.status == 200 and s.error is None, s
        assert s.finish_reasons == ["abort"] and s.done and s.after_done == 0, s
        assert SHUTDOWN_TIMEOUT_S - 0.5 <= s.ended_at - signalled <= SHUTDOWN_TIMEOUT_S + 2.0, (s, signalled)
    queued = [s for s in streams if chunks_before[s.index] == 0]
    assert len(queued) == STREAMS - 8
    for s in queued:
        assert (s.status, s.retry_after, s.error_code, s.chunks, s.error) == (503, "1", "shutting_down", 0, None), s
        assert s.ended_at - signalled <= 1.0, (s, signalled)
    assert len(decoding) >= 8 and all(s.chunks > chunks_before[s.index] for s in decoding)  # kept streaming
    # The durability flush ran after HTTP was done, and reported what it made durable.
    match = re.search(r"shutdown flush: durable \(flushed (\d+), missing (\d+).*?\)", log)
    assert match, log_tail(log)
    assert log.index("HTTP server stopped") < match.start() < log.index("bye")
    assert list((tmp_path / "ssd").rglob("*.mlxkv")), "the warm-up's prompt-cache entry is not on disk"
    assert exited_s <= SHUTDOWN_TIMEOUT_S + 6.0, exited_s  # ~the deadline, the flush, teardown
    print(
        f"SIGINT with {STREAMS} streams: streams ended {max(s.ended_at for s in streams) - signalled:.2f} s, "
        f"exit 0 after {exited_s:.2f} s; {match.group(0)}"
    )


def test_a_second_sigint_exits_at_once(model_dir, tmp_path):
    proc, base, log_path = start_server(model_dir, tmp_path)
    try:
        streams, threads = start_streams(base)
        wait_for(lambda: all_admitted(base, streams), 60, "32 streams admitted and 8 decoding")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)  # the graceful shutdown has begun; streams still run
        assert proc.poll() is None
        second = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("a second SIGINT did not exit within 10 s:\n" + log_tail(log_path.read_text()))
        exited_s = time.monotonic() - second
        for thread in threads:
            thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert exited_s <= 3.0, (exited_s, log_tail(log))
    assert "SIGINT: exiting now" in log, log_tail(log)
    # A second signal cut the drain: 130, the shell's code for an interrupted process.
    check_exit(code, log, (130,))
    assert all(not t.is_alive() for t in threads)  # no client left hanging on a dead server
    assert all(s.ended_at is not None and s.ended_at - second <= 3.0 for s in streams)
    print(
        f"second SIGINT: exit {code} after {exited_s:.2f} s; "
        f"{sum(s.done for s in streams)} streams got [DONE], {sum(s.error is not None for s in streams)} were cut"
    )
