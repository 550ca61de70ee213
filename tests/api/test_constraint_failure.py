"""A row whose output constraint fails mid-generation (TokenOut finish "error") reaches the client
as an error in the API's shape: 400 before the headers, the protocol's error frame after; never
a normal finish with unconstrained text."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.engine.rows import TokenOut
from tests.fakes import FakeTokenizer, FakeWorker, _FakeRow

CHAT = "/v1/chat/completions"
FAIL_AT = 3
MESSAGE = "the output constraint failed during generation: lexer limit exceeded"


class FailingGrammarWorker(FakeWorker):
    """Every row's grammar fails at token FAIL_AT, as model/engine/decoding.py reports it."""

    def _next_token(self, row: _FakeRow) -> TokenOut:
        if row.generated == FAIL_AT:
            row.generated += 1
            row.finished = True
            return TokenOut(row.spec.row_id, 2, "error", error=MESSAGE)
        return super()._next_token(row)


@asynccontextmanager
async def server(**config):
    worker = FailingGrammarWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        app = create_app(handles)
        yield app.test_client(), app.extensions["mlx_trio.metrics"], worker
        nursery.cancel_scope.cancel()


def frames(body: bytes) -> list[str]:
    return [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f]


CHAT_BODY = {"messages": [{"role": "user", "content": "json please"}], "max_tokens": 10}


async def test_whole_chat_answers_400_in_openai_shape(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    async with server() as (client, metrics, worker):
        response = await client.post(CHAT, json=CHAT_BODY)
        assert response.status_code == 400
        body = await response.get_json()
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"] == MESSAGE
        # The scheduler ended the row (no abort owed) and the server is fine for the next request.
        assert (await client.post(CHAT, json={**CHAT_BODY, "max_tokens": 2})).status_code == 200
        assert worker.violations == []
    [failed, _] = [r.getMessage() for r in caplog.records if r.name == "mlx_trio.requests"]
    line = json.loads(failed.removeprefix("request "))
    assert line["status"] == 400 and line["finish_reason"] == "error" and line["error"] == MESSAGE
    assert (
        metrics.registry.get_sample_value(
            "mlx_trio:requests_total", {"route": CHAT, "status": "400", "finish_reason": "error"}
        )
        == 1
    )


async def test_n_choices_fail_whole(autojump_clock):
    async with server(batch=4) as (client, _, _):
        response = await client.post(CHAT, json={**CHAT_BODY, "n": 2})
        assert response.status_code == 400
        assert (await response.get_json())["error"]["message"] == MESSAGE


async def test_chat_stream_ends_with_an_error_frame(autojump_clock):
    async with server() as (client, _, _):
        response = await client.post(CHAT, json={**CHAT_BODY, "stream": True})
        assert response.status_code == 200  # the headers went out before the failure
        data = frames(await response.get_data())
    assert data.pop() == "[DONE]"  # the error frame, then [DONE]: nothing else
    assert "[DONE]" not in data
    chunks = [json.loads(d) for d in data]
    error = chunks[-1]
    assert error == {"error": {"message": MESSAGE, "type": "invalid_request_error", "param": None, "code": None}}
    content = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert sum(1 for text in content if text) == FAIL_AT  # the tokens before the failure, not the failing one
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])  # never a "stop"


async def test_completions_whole_answers_400(autojump_clock):
    async with server() as (client, _, _):
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
        assert response.status_code == 400
        assert (await response.get_json())["error"]["message"] == MESSAGE


async def test_anthropic_whole_answers_400_in_its_shape(autojump_clock):
    async with server() as (client, _, _):
        body = {"model": "fake-model", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
        response = await client.post("/v1/messages", json=body)
        assert response.status_code == 400
        assert await response.get_json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": MESSAGE},
        }


async def test_anthropic_stream_sends_its_error_event(autojump_clock):
    async with server() as (client, _, _):
        body = {"model": "fake-model", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        response = await client.post("/v1/messages", json=body)
        text = (await response.get_data()).decode()
    last = text.strip().split("\n\n")[-1]  # the error event ends the stream
    assert last.startswith("event: error\n") and MESSAGE in last and '"invalid_request_error"' in last
    assert "message_stop" not in text


async def test_responses_whole_and_stream(autojump_clock):
    async with server() as (client, _, _):
        response = await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 10})
        assert response.status_code == 400
        assert (await response.get_json())["error"]["message"] == MESSAGE
        stream = await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 10, "stream": True})
        text = (await stream.get_data()).decode()
    assert "event: error" in text and "response.failed" in text and "response.completed" not in text
    events = {e["type"]: e for e in (json.loads(f.split("data: ", 1)[1]) for f in text.split("\n\n") if f.strip())}
    # The request's own constraint failed: the client's error, as chat and Anthropic report it.
    assert (events["error"]["code"], events["error"]["message"]) == ("invalid_request_error", MESSAGE)
    assert events["response.failed"]["response"]["error"] == {"code": "invalid_request_error", "message": MESSAGE}
