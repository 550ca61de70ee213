"""Structured outputs through the real server (real GPU worker, scheduler, app; no socket).

A random-weight tiny model emits noise; under a constraint every reply must parse / match.
Real threads: the real clock with a generous `trio.fail_after`.
"""

from __future__ import annotations

import json
import re

import pytest
import trio

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from model.text import grammar  # noqa: E402
from tests.realserver import CHAT, COMPLETIONS, complete, real_server  # noqa: E402

LIMIT_S = 180

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "temp", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def chat_body(i: int, **extra):
    return {
        "messages": [{"role": "user", "content": f"Weather report number {i}, please."}],
        "max_tokens": 200,
        **extra,
    }


async def post(server, path, body):
    response = await server.client.post(path, json=body)
    return response.status_code, await response.get_json(), response.headers


async def test_json_schema_regex_choice_and_invalid_over_http(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=8) as server:
            for i in range(4):
                status, body, headers = await post(
                    server, CHAT, chat_body(i, response_format=RESPONSE_FORMAT, temperature=1.0)
                )
                assert status == 200, body
                assert "Warning" not in headers
                choice = body["choices"][0]
                assert choice["finish_reason"] == "stop"
                jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)

            status, body, _ = await post(
                server,
                COMPLETIONS,
                {"prompt": "Name and number:", "guided_regex": REGEX, "max_tokens": 40, "temperature": 1.0},
            )
            assert status == 200 and re.fullmatch(REGEX, body["choices"][0]["text"], re.ASCII), body
            status, body, _ = await post(
                server, COMPLETIONS, {"prompt": "Mood:", "guided_choice": ["happy", "sad"], "max_tokens": 10}
            )
            assert status == 200 and body["choices"][0]["text"] in ("happy", "sad"), body

            streamed = await complete(
                server, chat_body(9, response_format={"type": "json_object"}, max_tokens=400), chat=True
            )
            if streamed.finish_reason == "stop":
                assert isinstance(json.loads(streamed.text), dict)
            else:  # any-JSON may be long; what there is must be a JSON prefix starting an object
                assert streamed.text.startswith("{")

            bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
            status, body, _ = await post(server, CHAT, chat_body(0, response_format=bad))
            assert status == 400 and "objectx" in body["error"]["message"], body
            status, body, _ = await post(server, COMPLETIONS, {"prompt": "x", "guided_regex": "a(b"})
            assert status == 400 and "unclosed group" in body["error"]["message"], body


async def test_eight_concurrent_constrained_and_free_requests_equal_solo(model_dir):
    def body(i):
        extra = {"temperature": 0, "max_tokens": 48}
        if i % 2 == 0:
            extra["response_format"] = RESPONSE_FORMAT
        elif i == 3:
            extra["guided_regex"] = REGEX
        return chat_body(i, **extra)

    bodies = [body(i) for i in range(8)]
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=8) as server:
            solo = [await complete(server, b, chat=True) for b in bodies]
            solo_steps = len(server.worker.step_widths())
            together = {}

            async def one(i):
                together[i] = await complete(server, bodies[i], chat=True)

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
            widths = server.worker.step_widths()[solo_steps:]
    assert max(widths) >= 6, widths  # constrained and free rows really shared steps
    for i in range(8):
        assert together[i].text == solo[i].text and together[i].finish_reason == solo[i].finish_reason, i
        if i % 2 == 0:
            assert solo[i].finish_reason == "stop"
            jsonschema.validate(json.loads(solo[i].text), SCHEMA)
    assert re.fullmatch(REGEX, solo[3].text, re.ASCII)


async def test_without_a_grammar_engine_the_request_is_served_with_a_warning(model_dir, monkeypatch):
    monkeypatch.setattr(grammar, "_ll", None)
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=2) as server:
            status, body, headers = await post(
                server, CHAT, chat_body(1, response_format=RESPONSE_FORMAT, max_tokens=8)
            )
            assert status == 200, body
            assert "not enforced" in headers.get("Warning", ""), dict(headers)
            status, body, headers = await post(server, CHAT, chat_body(1, max_tokens=4))
            assert status == 200 and "Warning" not in headers
