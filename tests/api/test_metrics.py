"""GET /metrics on a FakeWorker: exact virtual-time latencies, token counters, aborts by phase,
scrape-time gauges, and a registry per app."""

from __future__ import annotations

import json
import math
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.observability.metrics import Metrics, token_buckets
from tests.fakes import FakeTokenizer, FakeWorker

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@asynccontextmanager
async def server(worker: FakeWorker | None = None, **config):
    worker = worker or FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        app = create_app(handles)
        yield app.test_client(), app.extensions["mlx_trio.metrics"], handles
        nursery.cancel_scope.cancel()


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def scrape(client) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain; version=0.0.4")
    text = (await response.get_data()).decode()
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def leave_mid_stream(client, path: str, body: dict, *, after_chunks: int = 0, after_s: float = 0.0) -> None:
    """Open a stream, read some chunks (or wait), then disconnect."""
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        for _ in range(after_chunks):
            await conn.receive()
        await trio.sleep(after_s)
        await conn.disconnect()
        conn._client_send.close()  # quart-trio's test client hangs on a disconnect unless its send side is closed


async def test_exposition_has_the_vllm_style_names(autojump_clock):
    async with server() as (client, _, _):
        await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        samples = await scrape(client)
    names = {key.split("{")[0] for key in samples}
    for name in [
        "mlx_trio:num_requests_running",
        "mlx_trio:num_requests_waiting",
        "mlx_trio:prompt_tokens_total",
        "mlx_trio:generation_tokens_total",
        "mlx_trio:request_success_total",
        "mlx_trio:requests_total",
        "mlx_trio:time_to_first_token_seconds_bucket",
        "mlx_trio:inter_token_latency_seconds_bucket",
        "mlx_trio:e2e_request_latency_seconds_bucket",
        "mlx_trio:request_queue_time_seconds_bucket",
        "mlx_trio:prefix_cache_queries_total",
        "mlx_trio:prefix_cache_hits_total",
        "mlx_trio:prompt_cache_hits_total",
        "mlx_trio:prompt_cache_misses_total",
        "mlx_trio:prompt_cache_bytes",
        "mlx_trio:admission_rejections_total",
        "mlx_trio:engine_healthy",
    ]:
        assert name in names, name
    assert not any(n.startswith("mlx_trio:ssd_cache") for n in names)  # no SSD tier: no series


async def test_a_completion_is_observed_with_exact_virtual_latencies(autojump_clock):
    async with server() as (client, metrics, _):
        prompt = FakeTokenizer().encode_chat([{"role": "user", "content": "hi"}])
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        assert (await client.post(CHAT, json=body)).status_code == 200
    chunks = math.ceil((len(prompt) - 1) / 4)  # FakeWorker prefills prompt[:-1] in chunks of 4
    ttft = chunks * 0.1 + 0.1  # + the join's forward
    assert value(metrics, "mlx_trio:requests_total", route=CHAT, status="200", finish_reason="length") == 1
    assert value(metrics, "mlx_trio:request_success_total", finished_reason="length") == 1
    assert value(metrics, "mlx_trio:prompt_tokens_total") == len(prompt)
    assert value(metrics, "mlx_trio:generation_tokens_total") == 5
    assert value(metrics, "mlx_trio:prefix_cache_queries_total") == len(prompt)
    assert value(metrics, "mlx_trio:prefix_cache_hits_total") == 0
    assert value(metrics, "mlx_trio:time_to_first_token_seconds_count") == 1
    assert value(metrics, "mlx_trio:time_to_first_token_seconds_sum") == pytest.approx(ttft)
    assert value(metrics, "mlx_trio:inter_token_latency_seconds_count") == 4
    assert value(metrics, "mlx_trio:inter_token_latency_seconds_sum") == pytest.approx(0.4)
    assert value(metrics, "mlx_trio:e2e_request_latency_seconds_sum") == pytest.approx(ttft + 0.4)
    assert value(metrics, "mlx_trio:request_queue_time_seconds_sum") == 0
    assert value(metrics, "mlx_trio:request_generation_tokens_sum") == 5


async def test_finish_reasons_stop_and_error(autojump_clock):
    eos_worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, eos_at=lambda spec: 3)
    async with server(eos_worker) as (client, metrics, _):
        await client.post(TEXT, json={"prompt": "x", "max_tokens": 10})
        assert value(metrics, "mlx_trio:request_success_total", finished_reason="stop") == 1
    async with server(FakeWorker(fail_step_at=2)) as (client, metrics, _):
        response = await client.post(TEXT, json={"prompt": "x", "max_tokens": 10})
        assert response.status_code == 500
        assert value(metrics, "mlx_trio:requests_total", route=TEXT, status="500", finish_reason="error") == 1


async def test_client_abort_mid_decode(autojump_clock):
    async with server(FakeWorker(step_cost=1.0)) as (client, metrics, handles):
        await leave_mid_stream(
            client, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 50}, after_chunks=3
        )
        await trio.sleep(2)
        assert handles.scheduler.counters.aborted_rows == 1
    assert value(metrics, "mlx_trio:request_aborts_total", phase="decode", cause="client") == 1
    assert value(metrics, "mlx_trio:requests_total", route=CHAT, status="200", finish_reason="abort") == 1
    assert value(metrics, "mlx_trio:request_success_total", finished_reason="abort") == 1
    assert handles.scheduler.table.rows() == []  # no row, and so no observer, is held past its end


async def test_client_abort_while_queued_and_during_prefill(autojump_clock):
    worker = FakeWorker(prefill_cost=1.0, join_cost=1.0, step_cost=1.0)
    async with server(worker, batch=1) as (client, metrics, handles):
        async with trio.open_nursery() as nursery:
            # Holds the only row for 5 s (a 1-token prompt needs no prefill chunk).
            nursery.start_soon(partial(client.post, TEXT, json={"prompt": "a", "max_tokens": 4}))
            await trio.sleep(0.5)
            nursery.start_soon(partial(leave_mid_stream, client, TEXT, {"prompt": "queued"}, after_s=1.0))
            await trio.sleep(2.0)
            assert value(metrics, "mlx_trio:request_aborts_total", phase="queued", cause="client") == 1
        # A long prompt: 40 tokens = 10 prefill chunks of 1 s each; leave after 2.5 s.
        await leave_mid_stream(client, TEXT, {"prompt": "p" * 40}, after_s=2.5)
        await trio.sleep(2)
        assert value(metrics, "mlx_trio:request_aborts_total", phase="prefill", cause="client") == 1
        assert handles.scheduler.counters.aborted_rows == 2
        assert handles.admission.in_flight == 0
        assert handles.scheduler.table.rows() == []  # no row, and so no observer, is held past its end


async def test_running_and_waiting_gauges_and_rejections(autojump_clock):
    async with server(FakeWorker(step_cost=1.0), batch=1, max_queue=1) as (client, metrics, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, TEXT, json={"prompt": "a", "max_tokens": 5}))
            await trio.sleep(0.5)
            nursery.start_soon(partial(client.post, TEXT, json={"prompt": "b", "max_tokens": 5}))
            await trio.sleep(0.5)
            samples = await scrape(client)
            assert samples["mlx_trio:num_requests_running{}"] == 1
            assert samples["mlx_trio:num_requests_waiting{}"] == 1
            assert samples["mlx_trio:num_requests_in_flight{}"] == 2
            refused = await client.post(TEXT, json={"prompt": "c"})
            assert refused.status_code == 503
        samples = await scrape(client)
    assert samples['mlx_trio:admission_rejections_total{"reason": "queue_full"}'] == 1
    assert samples['mlx_trio:requests_total{"finish_reason": "none", "route": "/v1/completions", "status": "503"}'] == 1
    assert (
        samples['mlx_trio:requests_total{"finish_reason": "length", "route": "/v1/completions", "status": "200"}'] == 2
    )
    assert samples["mlx_trio:generation_tokens_total{}"] == 10  # the refused request counted no tokens
    assert samples["mlx_trio:num_requests_running{}"] == 0


async def test_unknown_paths_share_one_route_label(autojump_clock):
    async with server() as (client, metrics, _):
        for path in ("/nope", "/nope/1", "/v1/nothing"):
            await client.get(path)
        await client.get("/v1/models/fake-model")
    assert value(metrics, "mlx_trio:requests_total", route="unmatched", status="404", finish_reason="none") == 3
    assert (
        value(
            metrics, "mlx_trio:requests_total", route="/v1/models/<path:model_id>", status="200", finish_reason="none"
        )
        == 1
    )


async def test_each_app_has_its_own_registry(autojump_clock):
    async with server() as (client_a, metrics_a, _):
        async with server() as (client_b, metrics_b, _):
            await client_a.get("/v1/models")
            await client_a.get("/v1/models")
            await client_b.get("/v1/models")
    labels = dict(route="/v1/models", status="200", finish_reason="none")
    assert value(metrics_a, "mlx_trio:requests_total", **labels) == 2
    assert value(metrics_b, "mlx_trio:requests_total", **labels) == 1


def test_stats_collector_tolerates_absent_blocks_and_reads_the_ssd_tier():
    stats = {
        "batch": {"active_rows": 2, "pending_rows": 3, "kv_bytes": 50, "kv_budget_bytes": 200, "preemptions": 6},
        "ssd_cache": {
            "dir": "/x",
            "restores": 4,
            "spills": 7,
            "dropped_spills": 1,
            "failed_spills": 2,
            "restore_failures": 1,
            "demotions": 5,
            "entries": 9,
            "bytes": 1000,
            "pending_spills": 0,
        },
    }
    metrics = Metrics(stats=lambda: stats, healthy=lambda: True)
    get = metrics.registry.get_sample_value
    assert get("mlx_trio:num_requests_running") == 2 and get("mlx_trio:num_requests_waiting") == 3
    assert get("mlx_trio:kv_cache_usage_perc") == 0.25
    assert get("mlx_trio:num_preemptions_total") == 6
    assert get("mlx_trio:ssd_cache_restores_total") == 4 and get("mlx_trio:ssd_cache_spills_total") == 7
    assert get("mlx_trio:ssd_cache_dropped_spills_total") == 1 and get("mlx_trio:ssd_cache_failed_spills_total") == 2
    assert get("mlx_trio:ssd_cache_restore_failures_total") == 1
    assert get("mlx_trio:ssd_cache_entries") == 9 and get("mlx_trio:ssd_cache_bytes") == 1000
    assert get("mlx_trio:ssd_cache_max_bytes") is None  # a key that is absent is skipped
    assert get("mlx_trio:prompt_cache_hits_total") is None  # so is a whole block
    assert b"mlx_trio:engine_healthy 1.0" in metrics.exposition()

    def broken():
        raise RuntimeError("stats exploded")

    assert b"mlx_trio:requests_total" in Metrics(stats=broken).exposition()  # the scrape survives
    assert Metrics(stats=dict).exposition()


def test_observer_api_can_be_called_directly():
    metrics = Metrics()
    metrics.observe_request(
        route="/v1/messages",
        status=200,
        finish_reason="stop",
        generation=True,
        ttft=0.5,
        e2e=2.0,
        queue_time=0.1,
        prompt_tokens=10,
        cached_tokens=4,
        generated_tokens=3,
        itl=[0.2, 0.3],
    )
    get = metrics.registry.get_sample_value
    assert get("mlx_trio:prefix_cache_hits_total") == 4 and get("mlx_trio:inter_token_latency_seconds_count") == 2
    assert get("mlx_trio:request_queue_time_seconds_sum") == pytest.approx(0.1)


def test_token_buckets():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000


async def test_every_surface_is_observed(autojump_clock):
    async with server() as (client, metrics, _):
        anthropic = {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/messages", json=anthropic)).status_code == 200
        assert (await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})).status_code == 200
    for route in ("/v1/messages", "/v1/responses"):
        assert value(metrics, "mlx_trio:requests_total", route=route, status="200", finish_reason="length") == 1
    assert value(metrics, "mlx_trio:generation_tokens_total") == 6
    assert value(metrics, "mlx_trio:time_to_first_token_seconds_count") == 2
