"""Streams through a default-config nginx arrive as fast as direct ones: the real server stack
(tests/live_http.py) serving a scripted tiny model, and nginx run in the foreground from a
minimal nginx.conf whose only setting is the `proxy_pass` (so `proxy_buffering` is on, as in
every stock install). The streams' `X-Accel-Buffering: no` is what turns nginx's buffering off
for them (api/http/wire.py). Skipped where the `nginx` binary is absent (.ci/run installs it)."""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.synth import write_scripted_model_dir
from tests.live_http import serve_in_thread

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="the nginx binary is not installed (.ci/run installs it)")

SCRIPT = tuple(f" w{i}" for i in range(48))  # a stream long enough for nginx to buffer it
TRIALS = 5
MARGIN_S = 0.05

NGINX_CONF = """\
{user}daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass {upstream};
        }}
    }}
}}
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Twelve layers: a few ms a token on CPU, so a buffering nginx, which passes a stream on in
    # 4 KiB pieces (~20 frames), would hold the first token back by a few hundred ms.
    model_dir = write_scripted_model_dir(
        tmp_path_factory.mktemp("nginx-model"), list(SCRIPT), num_hidden_layers=12, hidden_size=256
    )
    with serve_in_thread(model_dir, served_model_name=("m",)) as base:
        yield base


@pytest.fixture(scope="module")
def proxy(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert NGINX is not None
    tmp = tmp_path_factory.mktemp("nginx")
    port = _free_port()
    user = "user root;\n" if os.geteuid() == 0 else ""  # else its worker cannot write tmp (0700)
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(user=user, tmp=tmp, port=port, upstream=upstream))
    process = subprocess.Popen(
        [NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                pytest.fail(f"nginx exited: {process.stderr.read().decode() if process.stderr else ''}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("nginx did not start: " + (tmp / "error.log").read_text())
            time.sleep(0.05)
        yield base
    finally:
        process.kill()
        process.wait(timeout=10)


def first_token_s(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed request to the arrival of the bytes of its first token."""
    started = time.perf_counter()
    with client.stream("POST", base + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        seen = b""
        for data in response.iter_raw():
            seen += data
            if SCRIPT[0].strip().encode() in seen:  # (the first piece loses its leading space)
                return time.perf_counter() - started
    raise AssertionError(f"no token in the stream: {seen[:300]!r}")


STREAMS = {
    "openai": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("protocol", sorted(STREAMS))
def test_first_token_through_nginx_is_as_fast_as_direct(upstream: str, proxy: str, protocol: str) -> None:
    path, body = STREAMS[protocol]
    direct: list[float] = []
    proxied: list[float] = []
    with httpx.Client(timeout=30) as client:
        # The header nginx reads (and does not pass on).
        assert client.post(upstream + path, json={**body, "stream": True}).headers["x-accel-buffering"] == "no"
        first_token_s(client, upstream, path, body)  # warm both paths' connections and the engine
        first_token_s(client, proxy, path, body)
        for _ in range(TRIALS):
            direct.append(first_token_s(client, upstream, path, body))
            proxied.append(first_token_s(client, proxy, path, body))
    gap = statistics.median(proxied) - statistics.median(direct)
    assert gap <= MARGIN_S, f"through nginx {proxied}, direct {direct}"
