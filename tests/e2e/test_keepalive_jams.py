"""No request can jam a keep-alive connection: real server (`python -m actors.serve`, tiny model,
real engine), real sockets, one raw HTTP/1.1 connection per test.

Before api/http/connection.py, quart-trio cancelled hypercorn's end-of-response bookkeeping: after an
answer given before its body had arrived the next request on the connection was never
answered, idle connections were never closed and `Connection: close` was ignored.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.http.connection import DRAIN_SECONDS
from tests.e2e.server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
IDLE_TIMEOUT_S = 1.0
ANSWER_LIMIT_S = 10.0  # every answer the tests wait for; a jammed connection times out instead
API_KEY = "test-key"
CAP_MB = 1.0
CAP = int(CAP_MB * 2**20)

pytestmark = pytest.mark.slow


class Conn:
    """One raw HTTP/1.1 connection: write requests as bytes, read responses by Content-Length."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_LIMIT_S)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buffer += data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        """True when the server closes (EOF or reset) before the socket timeout."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def request(
    method: str, path: str, body: bytes = b"", *, key: str | None = API_KEY, length: int | None = None, extra: str = ""
) -> bytes:
    """`length`: the Content-Length to declare (default: the body's, for a POST)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    if length is None and (body or method == "POST"):
        length = len(body)
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode() + body


CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
PADDED = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 200_000}]}).encode()


@pytest.fixture(scope="module")
def port(tiny_model_factory) -> Iterator[int]:
    port = free_port()
    args = [
        *(sys.executable, "-m", "actors.serve", "--model", str(tiny_model_factory("qwen3"))),
        *("--served-model-name", "tiny"),  # the name CHAT and PADDED carry
        *("--port", str(port), "--prompt-cache", "0", "--shutdown-timeout", "1"),
        *("--api-key", API_KEY, "--max-body-mb", str(CAP_MB), "--idle-timeout", str(IDLE_TIMEOUT_S)),
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=5)
    log = "".join(output)
    assert "Traceback" not in log, log


def answered_chat(conn: Conn) -> None:
    started = time.monotonic()
    conn.send(request("POST", "/v1/chat/completions", CHAT))
    status, _, body = conn.response()
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
    assert time.monotonic() - started < ANSWER_LIMIT_S


EARLY_ANSWERS = [
    # (request, status, error code): each answered before the route reads its body
    (request("POST", "/v1/chat/completions", b'{"pad": "' + b"x" * (CAP + CAP // 2) + b'"}'), 413, "request_too_large"),
    (request("POST", "/v1/chat/completions", PADDED, key="wrong"), 401, "invalid_api_key"),
    (request("POST", "/v1/no-such-route", PADDED), 404, "not_found"),
    (request("POST", "/health", PADDED), 405, "method_not_allowed"),
]


def test_early_answers_never_jam_one_keep_alive_connection(port):
    conn = Conn(port)
    try:
        for _ in range(20):
            for raw, status, code in EARLY_ANSWERS:
                conn.send(raw)
                got, headers, body = conn.response()
                assert (got, json.loads(body)["error"]["code"]) == (status, code), body
                assert headers.get("connection") != "close"  # drained: the connection stays usable
                answered_chat(conn)
            conn.send(request("POST", "/admin/cache/flush", PADDED))
            status, _, body = conn.response()
            assert status == 200, body
            answered_chat(conn)
    finally:
        conn.close()


def test_an_answer_before_the_body_arrives_waits_for_it(port):
    """The 404 jam's cause: the route answered while the body was still on its way; the body must
    be read before the connection is reused (here it arrives 0.3 s after the headers)."""
    conn = Conn(port)
    try:
        raw = request("POST", "/v1/no-such-route", b'{"a": 1}')
        head, body = raw[: -len(b'{"a": 1}')], b'{"a": 1}'
        for _ in range(3):
            conn.send(head)
            time.sleep(0.3)
            conn.send(body)
            status, headers, _ = conn.response()
            assert status == 404 and headers.get("connection") != "close"
            answered_chat(conn)
    finally:
        conn.close()


def test_a_body_that_never_comes_closes_the_connection_after_the_answer(port):
    conn = Conn(port)
    try:
        started = time.monotonic()
        conn.send(request("POST", "/v1/no-such-route", length=100))
        status, headers, _ = conn.response()
        assert status == 404 and headers["connection"] == "close"
        assert DRAIN_SECONDS - 0.5 < time.monotonic() - started < DRAIN_SECONDS + 2
        assert conn.closed_by_server()
    finally:
        conn.close()


def test_a_declared_body_past_the_drain_bound_is_refused_and_closed_at_once(port):
    conn = Conn(port)
    try:
        conn.send(request("POST", "/v1/chat/completions", length=100 * CAP))
        status, headers, body = conn.response()
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert conn.closed_by_server()
    finally:
        conn.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(port):
    conn = Conn(port)
    try:
        answered_chat(conn)
        idle_since = time.monotonic()
        assert conn.closed_by_server()
        assert time.monotonic() - idle_since <= IDLE_TIMEOUT_S + 1
    finally:
        conn.close()


def test_idle_timeout_also_ends_a_connection_that_stays_idle_after_an_early_answer(port):
    conn = Conn(port)
    try:
        conn.send(request("POST", "/v1/chat/completions", PADDED, key="wrong"))
        assert conn.response()[0] == 401
        idle_since = time.monotonic()
        assert conn.closed_by_server()
        assert time.monotonic() - idle_since <= IDLE_TIMEOUT_S + 1
    finally:
        conn.close()


def test_connection_close_from_the_client_is_honoured(port):
    conn = Conn(port)
    try:
        conn.send(request("GET", "/health", extra="Connection: close\r\n"))
        status, headers, _ = conn.response()
        assert status == 200 and headers["connection"] == "close"
        closing = time.monotonic()
        assert conn.closed_by_server()
        assert time.monotonic() - closing < IDLE_TIMEOUT_S / 2  # closed by the answer, not the idle timer
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "envelope"),
    [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")],
)
def test_oversized_headers_get_a_431_in_the_api_shape(port, path, envelope):
    conn = Conn(port)
    try:
        conn.send(request("POST", path, b"{}", extra=f"X-Big: {'a' * 100_000}\r\n"))
        status, headers, body = conn.response()
        assert status == 431 and headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        error = json.loads(body)
        if envelope == "anthropic":
            assert error["type"] == "error" and "too large" in error["error"]["message"]
        else:
            assert error["error"]["code"] == "request_header_fields_too_large"
    finally:
        conn.close()
