"""Anthropic `cache_control` end to end on the real engine (tiny qwen3 model, CPU, in process): a
system-prompt breakpoint stores that prefix on the first call (cache_creation_input_tokens) and
the second call with another last user message reads it back (cache_read_input_tokens), streamed
and not; a bad ttl is a 400 in Anthropic's envelope."""

from __future__ import annotations

import json
from typing import Any

import trio

from tests.realserver import JSON, RealServer, real_server

LIMIT_S = 120
MESSAGES = "/v1/messages"
SYSTEM = " ".join(f"Rule {i}: answer briefly and name the colour {i % 7}." for i in range(60))


def body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "max_tokens": 4,
        "temperature": 0,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


async def streamed(server: RealServer, payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(message_start usage, message_delta usage) of a streamed request."""
    async with server.client.request(MESSAGES, method="POST", headers=JSON) as conn:
        await conn.send(json.dumps({**payload, "stream": True}).encode())
        await conn.send_complete()
        data = b""
        while b"event: message_stop" not in data:
            try:
                data += await conn.receive()
            except trio.EndOfChannel:
                break
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    return start, delta


def prompt_total(usage: dict[str, Any]) -> int:
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)


async def test_a_system_breakpoint_is_created_then_read(qwen3_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(qwen3_dir, prompt_cache_bytes=1 << 30) as server:
            count = await server.client.post("/v1/messages/count_tokens", json=body("What is red?"))
            prompt_tokens = (await count.get_json())["input_tokens"]
            response = await server.client.post(MESSAGES, json=body("What is red?"))
            assert response.status_code == 200, await response.get_data()
            first = (await response.get_json())["usage"]
            created = first.get("cache_creation_input_tokens", 0)
            assert created >= 256 and "cache_read_input_tokens" not in first
            assert prompt_total(first) == prompt_tokens
            keys = await server.worker.inner.run_exclusive(lambda engine: engine.prompt_cache.keys())
            assert created in {len(tokens) for _, tokens in keys}  # the hinted prefix is stored, exactly

            start, delta = await streamed(server, body("And what is blue, then?"))
            assert start == {**delta, "output_tokens": start["output_tokens"]}  # the same split at both ends
            # The system prefix is read back (with at most the next turn's opening tokens that the
            # previous call's stored prompt also holds); nothing new is created.
            assert created <= delta["cache_read_input_tokens"] < created + 8
            assert "cache_creation_input_tokens" not in delta


async def test_a_bad_ttl_is_an_anthropic_400(qwen3_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(qwen3_dir, prompt_cache_bytes=1 << 30) as server:
            bad = body("hi")
            bad["system"][0]["cache_control"] = {"type": "ephemeral", "ttl": "2h"}
            response = await server.client.post(MESSAGES, json=bad)
            assert response.status_code == 400
            error = await response.get_json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert "ttl" in error["error"]["message"]
