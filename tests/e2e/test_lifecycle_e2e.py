"""The server's lifecycle through a real `python -m actors.serve` subprocess and a tiny model.

* SIGINT with requests queued behind a generating one (`--batch 1`): each queued request gets
  503 + Retry-After in its protocol's error envelope (never 200 with empty content), /health is
  503 during the grace period, the generating stream ends with its final chunk, exit 0.
* A second SIGINT cuts the drain: exit 130.
* Start-up failures — an empty --model directory, an unsupported model_type, a busy port — are
  one line on stderr, no traceback, exit 2, within 2 s of launch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import httpx
import pytest

from tests.e2e.server_process import wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 3.0
STARTUP_LIMIT_S = 120.0

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3", max_position_embeddings=1 << 16)


def launch(args: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.serve", *args],
            cwd=ROOT,
            stderr=log_file,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )


def start_server(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    log_path = tmp_path / "server.log"
    proc = launch(
        ["--model", str(model_dir), "--port", "0", "--batch", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        log_path,
    )
    return proc, wait_until_serving(proc, log_path, STARTUP_LIMIT_S), log_path


@attrs.define
class Call:
    name: str
    path: str
    body: dict
    status: int | None = None
    headers: dict = attrs.Factory(dict)
    payload: object = None
    chunks: int = 0
    final: str | None = None  # the streamed finish reason (OpenAI text completion)
    error: str | None = None


def run_call(base: str, call: Call) -> None:
    try:
        with httpx.stream("POST", f"{base}{call.path}", json=call.body, timeout=60) as response:
            call.status = response.status_code
            call.headers = dict(response.headers)
            if response.status_code != 200 or not call.body.get("stream"):
                call.payload = json.loads(response.read())
                return
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    call.chunks += 1
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    call.final = choices[0].get("finish_reason") or call.final
    except Exception as exc:  # recorded and checked by the test
        call.error = f"{type(exc).__name__}: {exc}"


def start(base: str, call: Call) -> threading.Thread:
    thread = threading.Thread(target=run_call, args=(base, call), daemon=True)
    thread.start()
    return thread


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def queued_calls(model: str) -> list[Call]:
    chat = [{"role": "user", "content": "hello"}]
    return [
        Call("openai", "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 8}),
        Call("openai stream", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 8, "stream": True}),
        Call("anthropic", "/v1/messages", {"model": model, "max_tokens": 8, "messages": chat, "stream": True}),
        Call("responses", "/v1/responses", {"model": model, "input": "hello", "max_output_tokens": 8}),
    ]


def generating_call(model: str) -> Call:
    return Call(
        "generating", "/v1/completions", {"model": model, "prompt": "once upon", "max_tokens": 50_000, "stream": True}
    )


def busy_server(base: str) -> tuple[Call, list[Call], list[threading.Thread]]:
    """One stream generating and four requests queued behind it (--batch 1)."""
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    generating = generating_call(model)
    threads = [start(base, generating)]
    wait_for(lambda: generating.chunks > 0, 60, "the first stream generating")
    calls = queued_calls(model)
    threads += [start(base, call) for call in calls]
    wait_for(
        lambda: httpx.get(f"{base}/stats", timeout=10).json()["batch"]["pending_rows"] == len(calls),
        60,
        "four requests queued",
    )
    return generating, calls, threads


@pytest.mark.slow
def test_sigint_answers_queued_requests_503_and_health_503_then_exits_0(model_dir, tmp_path):
    proc, base, log_path = start_server(model_dir, tmp_path)
    health: list[tuple[int, dict, str | None]] = []
    try:
        generating, calls, threads = busy_server(base)
        assert all(call.status is None for call in calls)  # queued: no status line sent yet
        proc.send_signal(signal.SIGINT)
        for call in calls:
            wait_for(lambda call=call: call.status is not None or call.error is not None, 10, call.name)
        # The grace period: the generating stream runs on, the listener answers 503.
        while proc.poll() is None and generating.final is None:
            try:
                response = httpx.get(f"{base}/health", timeout=2)
                health.append((response.status_code, response.json(), response.headers.get("retry-after")))
            except httpx.HTTPError:
                break  # the listener closed: the stream has just ended
            time.sleep(0.2)
        code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 15)
        for thread in threads:
            thread.join(timeout=10)
    finally:
        stop(proc)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    for call in calls:
        assert call.error is None and call.status == 503, call
        assert call.headers.get("retry-after") == "1", call
        if call.name == "anthropic":
            assert call.payload == {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "server is shutting down"},
            }, call
        else:
            assert call.payload["error"]["type"] == "server_error", call
            assert call.payload["error"]["code"] == "shutting_down", call
    assert generating.status == 200 and generating.final == "abort" and generating.error is None, generating
    assert len(health) >= 3, health  # probed across the grace period
    assert all(h == (503, {"status": "unavailable", "reason": "shutting down"}, "1") for h in health), health


def test_a_second_sigint_exits_130(model_dir, tmp_path):
    proc, base, log_path = start_server(model_dir, tmp_path)
    try:
        generating, calls, threads = busy_server(base)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None  # draining: the stream still runs
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=10)
        for thread in threads:
            thread.join(timeout=10)
    finally:
        stop(proc)
    log = log_path.read_text()
    assert code == 130, log[-3000:]
    assert "SIGINT: exiting now" in log


def failed_start(args: list[str], tmp_path: Path) -> tuple[int, str]:
    log_path = tmp_path / "failed.log"
    proc = launch(args, log_path)
    try:
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    return code, log_path.read_text()


def check_one_line_failure(code: int, log: str, expected: str) -> None:
    assert code == 2, log
    # Reported before anything slow: the model never started loading (a timed bound would be
    # flaky on a busy machine; the time is measured in the start-up benchmark, not asserted).
    assert "loading model" not in log, log
    assert "Traceback" not in log and "ExceptionGroup" not in log, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot serve: " in errors[0] and expected in errors[0], log


def test_an_empty_model_directory_fails_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, log = failed_start(["--model", str(empty), "--port", "0"], tmp_path)
    check_one_line_failure(code, log, "missing config.json")


def test_an_unsupported_model_type_fails_in_one_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "nonsense", "hidden_size": 8}))
    code, log = failed_start(["--model", str(bad), "--port", "0"], tmp_path)
    check_one_line_failure(code, log, "unsupported model_type 'nonsense'")


def test_a_busy_port_fails_in_one_line(model_dir, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, log = failed_start(["--model", str(model_dir), "--port", str(port)], tmp_path)
    check_one_line_failure(code, log, f"cannot listen on 127.0.0.1:{port}")
    assert "loading model" not in log  # the port is bound before any load
