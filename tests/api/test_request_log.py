"""One structured log line per request; prompt text only with --log-prompts."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker

CHAT = "/v1/chat/completions"
SECRET = "my-very-private-prompt"


class DecodingTokenizer(FakeTokenizer):
    def decode(self, ids):
        return "|".join(str(i) for i in ids)


@asynccontextmanager
async def server(worker: FakeWorker | None = None, **config):
    worker = worker or FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: DecodingTokenizer()
        )
        yield create_app(handles).test_client(), handles
        nursery.cancel_scope.cancel()


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.DEBUG, logger="mlx_trio.requests")

    def read() -> list[dict]:
        out = []
        for record in caplog.records:
            if record.name == "mlx_trio.requests":
                assert record.getMessage().startswith("request {")
                fields = json.loads(record.getMessage().removeprefix("request "))
                assert fields == record.request  # the same fields ride along for structured handlers
                out.append({**fields, "_level": record.levelno})
        return out

    return read


async def test_one_line_per_request_with_its_generation(autojump_clock, lines, caplog):
    async with server() as (client, _):
        body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 3}
        response = await client.post(CHAT, json=body, headers={"X-Request-Id": "abc-123"})
        assert response.headers["X-Request-Id"] == "abc-123"
        await client.get("/v1/models")
    [chat, models] = lines()
    prompt_tokens = len(FakeTokenizer().encode_chat(body["messages"]))
    assert chat == {
        "id": "abc-123",
        "method": "POST",
        "route": CHAT,
        "status": 200,
        "client": None,
        "duration_ms": chat["duration_ms"],
        "lane": "batched",
        "prompt_tokens": prompt_tokens,
        "cached_tokens": 0,
        "generated_tokens": 3,
        "arrive_ms": chat["arrive_ms"],
        "queue_ms": 0.0,
        "prefill_ms": chat["prefill_ms"],
        "ttft_ms": chat["ttft_ms"],
        "finish_reason": "length",
        "client_abort": False,
        "_level": logging.INFO,
    }
    assert chat["prefill_ms"] > 0
    assert chat["ttft_ms"] == pytest.approx(chat["arrive_ms"] + chat["queue_ms"] + chat["prefill_ms"])
    assert chat["ttft_ms"] > 0 and chat["duration_ms"] == pytest.approx(chat["ttft_ms"] + 200.0)
    assert models["route"] == "/v1/models" and "prompt_tokens" not in models
    assert SECRET not in caplog.text  # never the prompt without --log-prompts
    assert "|" not in caplog.text


async def test_log_prompts_adds_the_templated_prompt(autojump_clock, lines):
    async with server(log_prompts=True) as (client, _):
        await client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 2})
    [line] = lines()
    assert line["prompt"] == "|".join(str(i) for i in FakeTokenizer().encode("hey"))


async def test_a_client_that_leaves_is_logged_as_an_abort(autojump_clock, lines):
    async with server(FakeWorker(step_cost=1.0)) as (client, _):
        async with client.request(
            "/v1/completions", method="POST", headers={"Content-Type": "application/json"}
        ) as conn:
            await conn.send(json.dumps({"prompt": "x", "max_tokens": 50, "stream": True}).encode())
            await conn.send_complete()
            for _ in range(3):
                await conn.receive()
            await conn.disconnect()
            conn._client_send.close()  # quart-trio's test client hangs on a disconnect unless its send side is closed
        await trio.sleep(2)
    [line] = lines()
    assert line["client_abort"] is True and line["finish_reason"] == "abort"
    assert line["abort_phase"] == "decode" and line["abort_cause"] == "client"
    assert line["status"] == 200 and 0 < line["generated_tokens"] < 50


async def test_refusals_and_rejections_are_logged(autojump_clock, lines):
    async with server(api_key="k", max_queue=1, batch=1) as (client, handles):
        await client.post(CHAT, json={})
        handles.admission.close(cutoff_after=1)
        await client.post("/v1/completions", json={"prompt": "x"}, headers={"x-api-key": "k"})
    [refused, shut] = lines()
    assert refused["status"] == 401 and "prompt_tokens" not in refused
    assert shut["status"] == 503 and shut["rejected"] == "shutting_down" and shut["finish_reason"] is None


async def test_health_and_metrics_scrapes_are_debug(autojump_clock, lines):
    async with server() as (client, _):
        await client.get("/health")
        await client.get("/metrics")
        await client.get("/nope", headers={"X-Request-Id": "bad id with spaces"})
    health, metrics, unknown = lines()
    assert health["_level"] == metrics["_level"] == logging.DEBUG
    assert unknown["_level"] == logging.INFO and unknown["route"] == "/nope" and unknown["status"] == 404
    assert unknown["id"].startswith("req-")  # an unsafe id is replaced, never echoed


async def test_the_request_id_header_is_an_option(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with server(request_id_header="X-Correlation-Id") as (client, _):
        response = await client.post(CHAT, json=body, headers={"X-Correlation-Id": "corr-7"})
        assert response.headers["X-Correlation-Id"] == "corr-7" and "X-Request-Id" not in response.headers
        response = await client.post(CHAT, json=body, headers={"X-Request-Id": "ignored"})
        assert response.headers["X-Correlation-Id"].startswith("req-")
    assert '"id": "corr-7"' in caplog.text
