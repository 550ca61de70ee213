"""Ctrl-C with an SDK's idle keep-alive connection open must not wait out the shutdown timeout.

hypercorn keeps such a connection through its whole graceful timeout; the root ends HTTP itself
once every admitted request is over (actors/root.py `_end_http_once_drained`).
"""

from __future__ import annotations

import threading
import time

import httpx

from tests.helpers.live import live_server

SHUTDOWN_TIMEOUT = 5  # live_server's --shutdown-timeout (hypercorn's graceful timeout is also 5)


def test_exit_does_not_wait_for_an_idle_keep_alive_connection(qwen3_dir):
    cm = live_server(qwen3_dir)
    server = cm.__enter__()
    closer = None
    with httpx.Client(timeout=30) as client:  # stays open (keep-alive) until after the exit
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 40}
        with client.stream("POST", f"{server.base}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            started = time.monotonic()
            closer = threading.Thread(target=cm.__exit__, args=(None, None, None))
            closer.start()  # SIGINT's path: admission closes, the stream finishes on its own
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        closer.join(timeout=30)
        elapsed = time.monotonic() - started
    assert not closer.is_alive()
    assert elapsed < SHUTDOWN_TIMEOUT - 1, f"exit took {elapsed:.1f} s: waited on the idle connection"
