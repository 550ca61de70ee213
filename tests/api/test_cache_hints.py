"""OpenAI's prompt-cache hints (api/cache_hints.py) on /v1/responses and /v1/chat/completions:
`prompt_cache_retention: "24h"` marks the system part and the whole conversation with a 24 h
ttl, `prompt_cache_key` joins the cache namespace only under --prompt-cache-key-isolation, bad
values are 400s naming the field, and the Response object echoes both as OpenAI does."""

from __future__ import annotations

from typing import Any

import pytest

from api.cache_hints import RETENTION_24H_S, key_namespace
from api.errors import ApiError
from api.openai.translate import chat_request
from api.responses.translate import input_items, responses_request
from tests.helpers.fake_server import server

openai = pytest.importorskip("openai")
from openai.types.responses import Response as SdkResponse  # noqa: E402


def responses(body: dict[str, Any]):
    return responses_request(body, input_items(body["input"]), body.get("instructions"), vocab_size=None)


def test_24h_retention_marks_the_system_part_and_the_whole_conversation():
    body = {"input": "hi", "instructions": "Be brief.", "prompt_cache_retention": "24h", "prompt_cache_key": "k"}
    request = responses(body)
    system, whole = request.cache_points
    assert system.ttl_s == whole.ttl_s == RETENTION_24H_S
    assert system.messages == ({"role": "system", "content": "Be brief."},)
    assert whole.messages == request.prompt.messages and len(whole.messages) == 2
    assert request.cache_key == "k"
    chat = chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "prompt_cache_retention": "24h"}, vocab_size=None
    )
    assert [p.messages for p in chat.cache_points] == [chat.prompt.messages]  # no system part to mark


@pytest.mark.parametrize("retention", [None, "in_memory", "in-memory"])
def test_in_memory_or_no_retention_marks_nothing(retention):
    body = {"input": "hi", "instructions": "Be brief.", "prompt_cache_retention": retention}
    assert responses(body).cache_points == ()


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt_cache_retention", "1h"),
        ("prompt_cache_retention", 24),
        ("prompt_cache_key", 7),
        ("prompt_cache_key", "k" * 1025),
    ],
)
def test_bad_hints_are_400s_naming_the_field(field, value):
    for translate in (
        lambda: responses({"input": "hi", field: value}),
        lambda: chat_request({"messages": [{"role": "user", "content": "hi"}], field: value}, vocab_size=None),
    ):
        with pytest.raises(ApiError) as raised:
            translate()
        assert raised.value.status == 400 and raised.value.param == field


async def test_the_key_is_a_namespace_only_under_isolation(autojump_clock):
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 2, "prompt_cache_key": "session-1"}
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for isolation, expected in ((False, ""), (True, key_namespace("session-1"))):
        async with server(prompt_cache_key_isolation=isolation) as (client, _, worker):
            response = await client.post("/v1/responses", json=body)
            assert response.status_code == 200, await response.get_data()
            answer = await response.get_json()
            assert (
                await client.post("/v1/chat/completions", json={**chat, "prompt_cache_key": "session-1"})
            ).status_code == 200
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert [spec.namespace for spec in worker.specs.values()] == [expected, expected, ""]
    assert expected.startswith("pck-") and key_namespace(None) == ""
    parsed = SdkResponse.model_validate(answer)
    assert parsed.prompt_cache_key == "session-1" and parsed.prompt_cache_retention is None


async def test_the_response_echoes_the_retention_as_openai_spells_it(autojump_clock):
    async with server() as (client, _, _):
        response = await client.post(
            "/v1/responses",
            json={"model": "fake-model", "input": "hi", "max_output_tokens": 2, "prompt_cache_retention": "in-memory"},
        )
        bad = await client.post(
            "/v1/responses", json={"model": "fake-model", "input": "hi", "prompt_cache_retention": "1d"}
        )
    assert SdkResponse.model_validate(await response.get_json()).prompt_cache_retention == "in_memory"
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "prompt_cache_retention"
