"""`--isolate`: the model's engine in a child process, through a real `python -m actors.serve` and
a tiny model.

* Greedy outputs (chat and completions, with logprobs) equal the in-process server's.
* kill -9 of the engine mid-stream ends that stream with an error event within 2 s; the server
  logs the cause and exit status, restarts the engine, and the next request (sent at once, so it
  waits for the restart) succeeds with the same tokens.
* Ctrl-C exits 0 with no engine process left (its SSD tier flushed: a restart finds the prompt on
  disk); a second signal exits 130; a server killed with -9 leaves no engine after 5 s.
* In a model pool, a request to another model succeeds while one model's engine restarts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from tests.helpers.processes import ServerProcess, alive, children, wait_gone
from tests.helpers.processes import free_port as port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROMPTS = ["the isolated engine", "a second prompt, a little longer than the first one", "x"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3", max_position_embeddings=1 << 16)


def start(model_dir, *args: str) -> tuple[ServerProcess, httpx.Client]:
    p = port()
    server = ServerProcess(["--model", str(model_dir), "--port", str(p), "--shutdown-timeout", "5", *args])
    client = httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=60)
    server.wait_healthy(client)
    return server, client


def outputs(client: httpx.Client) -> list[object]:
    """Greedy answers: chat texts, and completions' tokens with their logprobs."""
    found: list[object] = []
    for prompt in PROMPTS:
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0},
        )
        assert chat.status_code == 200, chat.text
        found.append(chat.json()["choices"][0]["message"]["content"])
        text = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2})
        assert text.status_code == 200, text.text
        choice = text.json()["choices"][0]
        found.append((choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]))
    return found


def the_engine(server: ServerProcess) -> int:
    engines = children(server.pid)
    assert len(engines) == 1, engines
    return engines[0]


@pytest.fixture(scope="module")
def expected(model_dir):
    """The in-process server's greedy outputs (no child process: one process serves)."""
    plain, client = start(model_dir)
    try:
        found = outputs(client)
    finally:
        client.close()
        assert plain.interrupt() == 0
    assert children(plain.pid) == []
    return found


def test_isolated_greedy_outputs_equal_the_in_process_servers(model_dir, expected):
    server, client = start(model_dir, "--isolate")
    try:
        assert outputs(client) == expected
    finally:
        client.close()
        assert server.interrupt() == 0


def test_a_killed_engine_ends_its_stream_restarts_and_exits_clean(model_dir, expected):
    server, client = start(model_dir, "--isolate")
    try:
        engine = the_engine(server)

        body = {"prompt": "a long stream", "max_tokens": 20000, "temperature": 0, "stream": True}
        frames: list[str] = []
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    frames.append(line)
                if len(frames) == 5:
                    break
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    frames.append(line)
            ended = time.monotonic() - killed
        assert ended < 2.0
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2].removeprefix("data: "))
        assert "error" in error and "engine process died" in error["error"]["message"], error

        again = outputs(client)  # sent at once: it waits for the new engine
        assert again == expected
        server.wait_log("died: killed by SIGKILL")
        assert "restarting its engine" in server.log
        restarted = the_engine(server)
        assert restarted != engine and not alive(engine)
        assert client.get("/health").json() == {"status": "ok"}
    finally:
        client.close()
        code = server.interrupt()
    assert code == 0, server.log[-4000:]
    assert not alive(restarted) and children(server.pid) == []


def test_a_killed_server_leaves_no_engine_behind(model_dir):
    server, client = start(model_dir, "--isolate")
    client.close()
    engine = the_engine(server)
    server.proc.kill()  # kill -9: no shutdown runs; the engine sees its socket close
    server.proc.wait()
    assert wait_gone(engine, 5.0), "the engine outlived its server by 5 s"
    server.kill()


def test_a_pool_model_serves_while_another_ones_engine_restarts(tiny_model_factory, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name, seed in (("a", 1), ("b", 2)):
        (models / name).symlink_to(tiny_model_factory("qwen3", seed=seed, max_position_embeddings=1 << 16))
    server, client = start(models / "a", "--models-dir", str(models), "--model-pool", "2", "--isolate")
    try:
        before = {m: _complete(client, m).json() for m in "ab"}
        statuses = {card["id"]: card["status"] for card in client.get("/v1/models").json()["data"]}
        assert statuses == {"a": "loaded", "b": "loaded"}
        engines = {m: int(server.log.split(f"model {m}: engine process ")[1].split()[0]) for m in "ab"}
        assert sorted(engines.values()) == sorted(children(server.pid))

        body = {"model": "a", "prompt": "a long stream", "max_tokens": 20000, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(engines["a"], signal.SIGKILL)
            killed = time.monotonic()
            during = _complete(client, "b")
            rest = [line for line in lines if line.startswith("data: ")]
            ended = time.monotonic() - killed
        assert during.status_code == 200 and during.json()["choices"] == before["b"]["choices"]
        assert ended < 2.0 and rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2].removeprefix("data: "))
        after = _complete(client, "a")
        assert after.status_code == 200 and after.json()["choices"] == before["a"]["choices"]
        assert alive(engines["b"]) and not alive(engines["a"])
    finally:
        client.close()
        code = server.interrupt()
    assert code == 0, server.log[-4000:]
    assert children(server.pid) == []


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 6, "temperature": 0})


def test_ctrl_c_flushes_the_engines_ssd_tier_and_a_restart_finds_it(model_dir, tmp_path):
    prompt = {"prompt": "a prompt worth keeping " * 20, "max_tokens": 4, "temperature": 0}
    first, client = start(model_dir, "--isolate", "--ssd-cache", str(tmp_path / "kv"))
    try:
        cold = client.post("/v1/completions", json=prompt).json()
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        flushed = client.post("/admin/cache/flush")
        assert flushed.status_code == 200 and flushed.json()["durable"] and flushed.json()["entries"] >= 1
    finally:
        client.close()
        code = first.interrupt()
    assert code == 0, first.log[-4000:]
    assert "[engine" in first.log and "shutdown flush: durable" in first.log
    assert children(first.pid) == []

    second, client = start(model_dir, "--isolate", "--ssd-cache", str(tmp_path / "kv"))
    try:
        warm = client.post("/v1/completions", json=prompt).json()
        assert warm["choices"] == cold["choices"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # restored from disk
    finally:
        client.close()
        assert second.interrupt() == 0


def test_a_second_signal_exits_130_and_leaves_no_engine(model_dir):
    server, client = start(model_dir, "--isolate", "--shutdown-timeout", "30")
    engine = the_engine(server)
    body = {"prompt": "a long stream", "max_tokens": 20000, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGINT)  # the drain would wait for the stream...
        server.wait_log("shutting down: admission closed")
        server.proc.send_signal(signal.SIGINT)  # ...the second signal cuts it
        assert server.proc.wait(timeout=10) == 130
    client.close()
    assert wait_gone(engine, 5.0)
    server.kill()
