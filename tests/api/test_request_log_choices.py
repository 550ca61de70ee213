"""A request with n choices submits its prompt once per choice but prefills it once: the log line
and the metrics count its prompt (and its cached prefix) once."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.engine.rows import RowOpened, RowSpec
from tests.fakes import FakeTokenizer, FakeWorker

CHAT = "/v1/chat/completions"
CACHED = 3


class CachingWorker(FakeWorker):
    """Reports a prompt-cache hit, and forks carry the leader's restored prefix as the engine does."""

    async def open_row(self, spec: RowSpec) -> RowOpened:
        opened = await super().open_row(spec)
        return RowOpened(spec.row_id, cached_tokens=CACHED, to_prefill=opened.to_prefill - CACHED)

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]:
        opened = await super().fork_rows(source_id, specs)
        return [RowOpened(o.row_id, cached_tokens=CACHED, to_prefill=0) for o in opened]


@asynccontextmanager
async def server(**config):
    worker = CachingWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        app = create_app(handles)
        yield app.test_client(), app.extensions["mlx_trio.metrics"]
        nursery.cancel_scope.cancel()


def request_lines(caplog) -> list[dict]:
    return [
        json.loads(r.getMessage().removeprefix("request ")) for r in caplog.records if r.name == "mlx_trio.requests"
    ]


async def test_n_choices_count_the_prompt_once(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    messages = [{"role": "user", "content": "one prompt, three answers"}]
    prompt_tokens = len(FakeTokenizer().encode_chat(messages))
    async with server(batch=4) as (client, metrics):
        response = await client.post(CHAT, json={"messages": messages, "max_tokens": 4, "n": 3})
        assert response.status_code == 200
        body = await response.get_json()
        single = await client.post(CHAT, json={"messages": messages, "max_tokens": 4})
        assert single.status_code == 200
    assert len(body["choices"]) == 3
    assert body["usage"]["prompt_tokens"] == prompt_tokens  # the API's own usage: the prompt once
    [three, one] = request_lines(caplog)
    assert three["prompt_tokens"] == prompt_tokens
    assert three["cached_tokens"] == CACHED
    assert three["generated_tokens"] == 3 * 4
    assert three["choices"] == 3
    assert one["prompt_tokens"] == prompt_tokens and "choices" not in one

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {})

    assert value("mlx_trio:prompt_tokens_total") == 2 * prompt_tokens
    assert value("mlx_trio:prefix_cache_queries_total") == 2 * prompt_tokens
    assert value("mlx_trio:prefix_cache_hits_total") == 2 * CACHED
    assert value("mlx_trio:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert value("mlx_trio:generation_tokens_total") == 3 * 4 + 4
