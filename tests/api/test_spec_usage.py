"""Speculative decoding as the HTTP surface reports it, over the real actors and a FakeWorker whose
tokens carry verification counts: usage `speculation` in every protocol, /stats `speculation`,
the /metrics counters and the request log's `+spec` lane."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import attrs
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.engine.rows import RowSpec
from tests.fakes import FakeTokenizer, FakeWorker

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
NGRAM = "ngram k=3 n=2..4"


def verifications(spec: RowSpec, position: int) -> tuple[int, int]:
    """A verification on every even position: 3 drafted, position % 3 accepted."""
    return (3, position % 3) if position % 2 == 0 else (0, 0)


def spec_worker(mode: str = NGRAM, spec_at=verifications) -> FakeWorker:
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, spec_at=spec_at)
    worker.info = attrs.evolve(worker.info, speculation=mode)
    return worker


# 5 tokens (positions 0..4): verifications at 0, 2, 4 → drafted 9, accepted 0 + 2 + 1.
FIVE = {"drafted": 9, "accepted": 3}


@asynccontextmanager
async def server(worker: FakeWorker, **config):
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        app = create_app(handles)
        yield app.test_client(), app.extensions["mlx_trio.metrics"]
        nursery.cancel_scope.cancel()


def chat(max_tokens: int = 5, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def request_lines(caplog) -> list[dict]:
    return [
        json.loads(r.getMessage().removeprefix("request "))
        for r in caplog.records
        if r.name == "mlx_trio.requests" and r.getMessage().startswith("request {")
    ]


async def test_chat_usage_stats_metrics_and_log_sum_the_verifications(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    async with server(spec_worker()) as (client, metrics):
        result = await (await client.post(CHAT, json=chat())).get_json()
        assert result["usage"]["speculation"] == FIVE and result["usage"]["completion_tokens"] == 5
        assert result["usage"]["lane"] == "batched+spec"
        await client.post(CHAT, json=chat(max_tokens=3))  # positions 0..2: drafted 6, accepted 2
        stats = await (await client.get("/stats")).get_json()
        assert stats["speculation"] == {"mode": NGRAM, "drafted": 15, "accepted": 5, "acceptance": round(5 / 15, 6)}
        assert metrics.registry.get_sample_value("mlx_trio:spec_drafted_tokens_total") == 15
        assert metrics.registry.get_sample_value("mlx_trio:spec_accepted_tokens_total") == 5
        exposition = (await (await client.get("/metrics")).get_data()).decode()
        assert "mlx_trio:spec_drafted_tokens_total 15.0" in exposition
    assert [line["lane"] for line in request_lines(caplog) if line["route"] == CHAT] == ["batched+spec"] * 2


async def test_choices_sum_and_the_stream_usage_chunk_carries_it(autojump_clock):
    async with server(spec_worker()) as (client, _):
        both = await (await client.post(CHAT, json=chat(n=2))).get_json()
        assert both["usage"]["speculation"] == {"drafted": 18, "accepted": 6}  # every choice's
        body = await (
            await client.post(CHAT, json=chat(stream=True, stream_options={"include_usage": True}))
        ).get_data()
        frames = [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f]
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["usage"]["speculation"] == FIVE


async def test_anthropic_and_responses_usage_carry_it(autojump_clock):
    async with server(spec_worker()) as (client, _):
        message = await (
            await client.post(MESSAGES, json={"model": "fake-model", **chat()}, headers={"anthropic-version": "1"})
        ).get_json()
        assert message["usage"]["speculation"] == FIVE and message["usage"]["output_tokens"] == 5
        stream = (
            await (await client.post(MESSAGES, json={"model": "fake-model", "stream": True, **chat()})).get_data()
        ).decode()
        deltas = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith('data: {"type": "message_')]
        assert [d["type"] for d in deltas] == ["message_start", "message_delta", "message_stop"]
        assert "speculation" not in deltas[0]["message"]["usage"]  # nothing verified yet
        assert deltas[1]["usage"]["speculation"] == FIVE
        response = await (
            await client.post(RESPONSES, json={"model": "fake-model", "input": "hi", "max_output_tokens": 5})
        ).get_json()
        assert response["usage"]["speculation"] == FIVE and response["usage"]["output_tokens"] == 5


async def test_a_row_without_verifications_reports_zeros_and_no_spec_lane(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    async with server(spec_worker(spec_at=lambda spec, position: (0, 0))) as (client, _):
        result = await (await client.post(CHAT, json=chat())).get_json()
        assert result["usage"]["speculation"] == {"drafted": 0, "accepted": 0}
        stats = await (await client.get("/stats")).get_json()
        assert stats["speculation"] == {"mode": NGRAM, "drafted": 0, "accepted": 0, "acceptance": None}
    assert [line["lane"] for line in request_lines(caplog) if line["route"] == CHAT] == ["batched"]


async def test_without_speculation_usage_has_no_field(autojump_clock):
    async with server(spec_worker(mode="", spec_at=lambda spec, position: (0, 0))) as (client, metrics):
        result = await (await client.post(CHAT, json=chat())).get_json()
        assert "speculation" not in result["usage"]
        message = await (await client.post(MESSAGES, json={"model": "fake-model", **chat()})).get_json()
        assert "speculation" not in message["usage"]
        response = await (
            await client.post(RESPONSES, json={"model": "fake-model", "input": "hi", "max_output_tokens": 5})
        ).get_json()
        assert "speculation" not in response["usage"]
        stats = await (await client.get("/stats")).get_json()
        assert stats["speculation"] == {"mode": "", "drafted": 0, "accepted": 0, "acceptance": None}
        assert metrics.registry.get_sample_value("mlx_trio:spec_drafted_tokens_total") == 0
