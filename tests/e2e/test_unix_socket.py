"""`--unix PATH`: HTTP over a unix socket, through a real `python -m actors.serve` and a tiny model.

The openai SDK, over an httpx unix-socket transport, streams a chat; the socket file is 0600 (or
--unix-mode), a stale one from a dead server is replaced, a live one is a one-line start-up error
(exit 2), its clients count as local for the admin routes, and the file is gone after Ctrl-C.
"""

from __future__ import annotations

import socket
import stat
import sys
import time

import pytest
from openai import OpenAI

from tests.helpers.processes import ServerProcess, unix_client

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="unix sockets")


def test_unix_socket_serves_the_sdk_and_goes_away(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3")
    path = tmp_path / "mlx.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a dead server's file: nobody listens on it
    stale.close()

    server = ServerProcess(["--model", str(model_dir), "--unix", str(path), "--shutdown-timeout", "5"])
    client = unix_client(path)
    try:
        server.wait_healthy(client)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert f"listening on unix:{path}" in server.log

        started = time.monotonic()
        second = ServerProcess(["--model", str(model_dir), "--unix", str(path)])
        assert second.proc.wait(timeout=30) == 2
        assert time.monotonic() - started < 10
        second.kill()
        errors = [line for line in second.lines if "cannot serve" in line]
        assert len(errors) == 1 and "another server is listening" in errors[0], second.log
        assert "Traceback" not in second.log

        sdk = OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=unix_client(path))
        stream = sdk.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": "hello over a unix socket"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        sdk.close()

        flushed = client.post("/admin/cache/flush")  # a unix peer without a proxy header is local
        assert flushed.status_code == 200, flushed.text
        proxied = client.post("/admin/cache/flush", headers={"X-Forwarded-For": "203.0.113.7"})
        assert proxied.status_code == 403
    finally:
        client.close()
        code = server.interrupt()
    assert code == 0, server.log[-4000:]
    assert not path.exists()


def test_unix_mode_widens_the_socket_for_a_proxy_group(tiny_model_factory, tmp_path):
    path = tmp_path / "group.sock"
    server = ServerProcess(["--model", str(tiny_model_factory("qwen3")), "--unix", str(path), "--unix-mode", "660"])
    client = unix_client(path)
    try:
        server.wait_healthy(client)
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    finally:
        client.close()
        assert server.interrupt() == 0
    assert not path.exists()
