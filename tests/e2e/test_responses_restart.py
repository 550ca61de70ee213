"""Stored Responses survive, end to end: `python -m actors.serve` subprocesses on one directory.

* Ctrl-C and a restart (with the SSD tier): GET answers the same object, and
  `previous_response_id` continues with the same greedy output as it did before the restart,
  reading the conversation's prefix from the SSD tier (`cached_tokens`).
* kill -9 right after a `store: true` response was answered (whole, and streamed to its final
  event), then a restart: GET is 200.
* A record corrupted on disk: the restarted server logs it, answers 404 for it (GET and
  `previous_response_id`), serves the others, and never a 500.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.server_process import Server

INSTRUCTIONS = " ".join(f"rule{i} agents keep long sessions and continue them after restarts" for i in range(40))


def create(server: Server, **body: Any) -> dict[str, Any]:
    response = server.client.post("/v1/responses", json={"max_output_tokens": 6, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def create_streamed(server: Server, **body: Any) -> dict[str, Any]:
    """The final object of a streamed response, read up to its final event only (completed, or
    incomplete at max_output_tokens)."""
    payload = {"max_output_tokens": 6, "temperature": 0, "stream": True, **body}
    with server.client.stream("POST", "/v1/responses", json=payload) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            event = json.loads(line[6:]) if line.startswith("data: ") else {}
            if event.get("type") in ("response.completed", "response.incomplete"):
                return event["response"]
    raise AssertionError("no final event")


def text_of(response: dict[str, Any]) -> str:
    return "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])


def record_of(store: Path, response_id: str) -> Path:
    [path] = store.glob(f"*/{response_id}.json")
    return path


def test_ctrl_c_then_restart_serves_and_continues_a_stored_response(qwen3_dir, tmp_path):
    ssd = tmp_path / "ssd"
    server = Server(qwen3_dir, "--ssd-cache", str(ssd))
    try:
        first = create(server, input="What do agents keep?", instructions=INSTRUCTIONS)
        items = server.client.get(f"/v1/responses/{first['id']}/input_items").json()
        before = create(server, input="And then?", previous_response_id=first["id"], max_output_tokens=8)
        assert server.stop() == 0, server.log[-3000:]
    finally:
        server.kill()
    assert "shutdown flush: durable" in server.log, server.log
    assert record_of(ssd / "responses", first["id"]).exists()

    server = Server(qwen3_dir, "--ssd-cache", str(ssd))
    try:
        got = server.client.get(f"/v1/responses/{first['id']}")
        assert got.status_code == 200 and got.json() == first
        assert server.client.get(f"/v1/responses/{first['id']}/input_items").json() == items
        after = create(server, input="And then?", previous_response_id=first["id"], max_output_tokens=8)
        assert server.stats()["ssd_cache"]["restores"] >= 1
        assert server.stop() == 0
    finally:
        server.kill()
    assert text_of(after) == text_of(before) and after["usage"]["output_tokens"] == before["usage"]["output_tokens"]
    assert after["usage"]["input_tokens"] == before["usage"]["input_tokens"]
    # The conversation's prefix came back from the SSD tier, not from a re-prefill.
    assert after["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]


def test_kill_9_right_after_the_answer_keeps_the_response(qwen3_dir, tmp_path):
    store = tmp_path / "responses"
    server = Server(qwen3_dir, "--response-store", str(store))
    try:
        whole = create(server, input="Remember this one.")
        streamed = create_streamed(server, input="And this one.")
    finally:
        server.kill()  # SIGKILL: no shutdown, no flush
    assert server.proc.returncode == -9

    server = Server(qwen3_dir, "--response-store", str(store))
    try:
        for response in (whole, streamed):
            got = server.client.get(f"/v1/responses/{response['id']}")
            assert got.status_code == 200, got.text
            assert got.json() == response
    finally:
        server.kill()


def test_a_corrupt_record_is_skipped_with_a_log_line_and_answered_404(qwen3_dir, tmp_path):
    store = tmp_path / "responses"
    server = Server(qwen3_dir, "--response-store", str(store))
    try:
        good, bad = create(server, input="Keep me."), create(server, input="Corrupt me.")
        assert server.stop() == 0
    finally:
        server.kill()
    path = record_of(store, bad["id"])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x04  # one flipped bit in the body
    path.write_bytes(bytes(data))

    server = Server(qwen3_dir, "--response-store", str(store))
    try:
        missing = server.client.get(f"/v1/responses/{bad['id']}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        continued = server.client.post(
            "/v1/responses", json={"input": "Go on.", "previous_response_id": bad["id"], "max_output_tokens": 2}
        )
        assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"
        assert server.client.get(f"/v1/responses/{bad['id']}/input_items").status_code == 404
        assert server.client.get(f"/v1/responses/{good['id']}").json() == good
        durable = server.stats()["responses_store"]["durable"]
        assert durable["corrupt"] == 1 and durable["entries"] == 1
    finally:
        server.kill()
    assert f"skipped a corrupt record {bad['id']}.json" in server.log
    assert "Traceback" not in server.log
