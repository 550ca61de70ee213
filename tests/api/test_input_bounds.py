"""Bounded validation of every protocol's input, the size bound before templating, and the log
status of a client that leaves a non-streaming request (fake worker, virtual time)."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api import fields, prompt_bounds
from api.anthropic.translate import messages_request
from api.app import create_app
from api.errors import ApiError
from api.http import offload
from tests.fakes import FakeTokenizer, FakeWorker

CHAT, TEXT, MESSAGES, COUNT, RESPONSES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
CONTEXT = 512
PROMPT_PARAM = {CHAT: "messages", TEXT: "prompt", RESPONSES: "input"}  # the field a too-long prompt names
USER = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def server(worker: FakeWorker | None = None):
    worker = worker or FakeWorker(prefill_cost=0.01, join_cost=0.01, step_cost=0.01)
    worker.info = attrs.evolve(worker.info, context_length=CONTEXT)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client(), worker
        nursery.cancel_scope.cancel()


def body_for(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"messages": USER, "max_tokens": 2, **extra}
    if path == TEXT:
        return {"prompt": "hi", "max_tokens": 2, **extra}
    if path == MESSAGES:
        return {"messages": USER, "max_tokens": 2, **extra}
    return {"input": "hi", "max_output_tokens": 2, **extra}


# (field, value, message substring); each is a 400 on every generating route
OUT_OF_BOUNDS = [
    ("temperature", 1e308, "temperature must be a non-negative float (at most"),
    ("temperature", 2.5, "temperature must be a non-negative float (at most"),
    ("temperature", 10**400, "temperature must be a non-negative float"),
    ("top_p", 1.0001, "top_p must be a float between 0 and 1"),
    ("top_k", 1e20, "top_k must be a non-negative integer (at most 2147483647)"),
    ("top_k", 2**31, "top_k must be a non-negative integer"),
    ("min_p", -0.1, "min_p must be a float between 0 and 1"),
    ("presence_penalty", 2.5, "presence_penalty must be a float between -2 and 2"),
    ("frequency_penalty", -3, "frequency_penalty must be a float between -2 and 2"),
    ("repetition_penalty", 1e308, "repetition_penalty must be a non-negative float (at most 100)"),
    ("repetition_context_size", 1e12, "repetition_context_size must be a non-negative integer (at most"),
    ("presence_context_size", 2**40, "presence_context_size must be a non-negative integer (at most"),
    ("seed", "1", "seed must be an integer"),
]


@pytest.mark.parametrize("path", [CHAT, TEXT, MESSAGES, RESPONSES])
async def test_absurd_numbers_are_400s_on_every_route(autojump_clock, path):
    async with server() as (client, worker):
        for name, value, message in OUT_OF_BOUNDS:
            response = await client.post(path, json=body_for(path, **{name: value}))
            assert response.status_code == 400, (path, name, value, await response.get_data())
            text = json.dumps(await response.get_json())
            assert message in text, (path, name, value, text)
        assert worker.specs == {}  # nothing out of bounds reached the engine


@pytest.mark.parametrize(
    "path,name,value,message",
    [
        (CHAT, "max_tokens", 1e12, "max_tokens must be a positive integer (at most"),
        (CHAT, "max_completion_tokens", 2**31, "max_completion_tokens must be a positive integer"),
        (TEXT, "max_tokens", 0, "max_tokens must be a positive integer"),
        (RESPONSES, "max_output_tokens", 10**30, "max_output_tokens must be a positive integer"),
        (CHAT, "logit_bias", {"5": 101}, "logit_bias values must be between -100 and 100"),
        (CHAT, "logit_bias", {"5": 10**400}, "logit_bias must be a dict of int to float"),
        (CHAT, "top_logprobs", 21, "top_logprobs must be at most"),
        (MESSAGES, "temperature", 1.5, "temperature must be a non-negative float (at most 1)"),
    ],
)
async def test_length_bias_and_protocol_specific_bounds(autojump_clock, path, name, value, message):
    async with server() as (client, worker):
        body = body_for(path)
        body[name] = value
        response = await client.post(path, json=body)
        assert response.status_code == 400, await response.get_data()
        assert message in json.dumps(await response.get_json())
        assert worker.specs == {}


async def test_values_at_the_bounds_are_accepted(autojump_clock):
    edge = {
        "temperature": 2,
        "top_p": 0,
        "top_k": fields.MAX_INT,
        "min_p": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": fields.MAX_REPETITION_PENALTY,
        "repetition_context_size": fields.MAX_INT,
        "logit_bias": {"3": -100},
        "seed": 2**80,
    }
    async with server() as (client, _):
        response = await client.post(CHAT, json=body_for(CHAT, **edge))
        assert response.status_code == 200, await response.get_data()
        response = await client.post(MESSAGES, json=body_for(MESSAGES, temperature=1, top_k=0))
        assert response.status_code == 200, await response.get_data()


@pytest.mark.parametrize(
    "body,message",
    [
        ({"messages": USER}, "max_tokens: Field required"),
        ({"messages": USER, "max_tokens": None}, "max_tokens: Field required"),
        ({"messages": USER, "max_tokens": 4, "tools": [{"name": 5, "input_schema": {}}]}, "tools.0.name"),
        ({"messages": USER, "max_tokens": 4, "tools": [{"name": "a b", "input_schema": {}}]}, "tools.0.name"),
        ({"messages": USER, "max_tokens": 4, "tools": [{"name": "x" * 65, "input_schema": {}}]}, "tools.0.name"),
        ({"messages": USER, "max_tokens": 4, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"messages": USER, "max_tokens": 4, "tools": ["f"]}, "tools.0: must be an object"),
        ({"messages": USER, "max_tokens": 4, "tools": [{"type": 5, "name": "f"}]}, "tools.0.type"),
        ({"max_tokens": 4}, "messages: at least one message is required"),
    ],
)
async def test_anthropic_required_fields_and_tool_names(autojump_clock, body, message):
    async with server() as (client, worker):
        response = await client.post(MESSAGES, json=body)
        assert response.status_code == 400, await response.get_data()
        error = await response.get_json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert message in error["error"]["message"], error
        assert worker.specs == {}


def test_anthropic_server_tools_are_still_dropped_and_count_tokens_needs_no_max_tokens():
    request = messages_request(
        {
            "messages": USER,
            "max_tokens": 4,
            "tools": [
                {"type": "web_search_20250305", "name": "web_search"},
                {"name": "get-weather_2", "input_schema": {}},
            ],
        }
    )
    assert [t["function"]["name"] for t in request.prompt.tools or ()] == ["get-weather_2"]
    with pytest.raises(ApiError, match="max_tokens"):
        messages_request({"messages": USER})


@pytest.mark.parametrize("path", [CHAT, MESSAGES, COUNT, RESPONSES, TEXT])
async def test_a_prompt_that_cannot_fit_is_refused_before_templating(path):  # real clock: a thread runs
    chars = CONTEXT * prompt_bounds.chars_per_token(FakeTokenizer()) + 1
    text = "x" * chars
    if path == TEXT:
        body: dict[str, Any] = {"prompt": text, "max_tokens": 2}
    elif path == RESPONSES:
        body = {"input": text, "max_output_tokens": 2}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with server() as (client, worker):
        with trio.fail_after(60):
            response = await client.post(path, json=body)
        assert response.status_code == 400, await response.get_data()
        payload = await response.get_json()
        assert "the prompt is too long" in json.dumps(payload), payload
        if path in (MESSAGES, COUNT):
            assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        else:
            assert payload["error"]["code"] == "context_length_exceeded"
            assert payload["error"]["param"] == PROMPT_PARAM[path]  # the protocol's own field
        assert worker.specs == {}


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES, TEXT])
async def test_a_prompt_over_the_window_is_context_length_exceeded_not_a_memory_refusal(autojump_clock, path):
    # Under the character bound, over the window once tokenized: refused on its tokens, the
    # memory budget's "raise --memory-budget" advice would be of no use.
    text = "x" * (CONTEXT + 50)
    if path == TEXT:
        body: dict[str, Any] = {"prompt": text, "max_tokens": 2}
    elif path == RESPONSES:
        body = {"input": text, "max_output_tokens": 2}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with server() as (client, worker):
        response = await client.post(path, json=body)
        assert response.status_code == 400, await response.get_data()
        payload = await response.get_json()
        error = payload["error"]
        assert error["message"].startswith("prompt is too long: "), error
        assert f"tokens > {CONTEXT - 1} maximum" in error["message"], error
        if path == MESSAGES:
            assert payload["type"] == "error" and error["type"] == "invalid_request_error"
        else:
            assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
            assert error["param"] == PROMPT_PARAM[path]
        assert worker.specs == {}


async def test_a_prompt_must_leave_room_for_one_token_and_max_tokens_is_clamped_to_the_rest(autojump_clock):
    async with server() as (client, _):
        full = await client.post(TEXT, json={"prompt": [5] * CONTEXT, "max_tokens": 2})
        assert full.status_code == 400
        assert (await full.get_json())["error"]["code"] == "context_length_exceeded"
        last = await client.post(TEXT, json={"prompt": [5] * (CONTEXT - 1), "max_tokens": 100})
        assert last.status_code == 200, await last.get_data()
        usage = (await last.get_json())["usage"]
        assert usage["completion_tokens"] == 1  # clamped to the room left, not refused


def test_the_size_bound_never_refuses_what_fits():
    tokenizer = FakeTokenizer()
    per_token = prompt_bounds.chars_per_token(tokenizer)
    assert per_token >= prompt_bounds.CHARS_PER_TOKEN_FLOOR
    prompt_bounds.check_chars(CONTEXT * per_token, tokenizer=tokenizer, context_length=CONTEXT)  # no raise
    with pytest.raises(ApiError, match="too long"):
        prompt_bounds.check_chars(CONTEXT * per_token + 1, tokenizer=tokenizer, context_length=CONTEXT)
    # Earlier turns' reasoning is dropped by templates: it is not counted.
    think = [
        {"role": "assistant", "content": "<think>" + "r" * 10_000 + "</think>ok"},
        {"role": "user", "content": "x"},
    ]
    assert prompt_bounds.message_chars(think) == 3


async def test_small_bodies_stay_inline_and_large_ones_go_to_a_thread():
    ran_on: list[bool] = []

    def where() -> None:
        import threading

        ran_on.append(threading.current_thread() is threading.main_thread())

    offload.note_body(offload.INLINE_BYTES)
    await offload.run(where)
    offload.note_body(offload.INLINE_BYTES + 1)
    await offload.run(where)
    await offload.to_thread(where)
    assert ran_on == [True, False, False]


# --- the log line of a client that leaves a non-streaming request ---------------------------------


async def test_a_dropped_non_streaming_request_is_logged_499(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    async with server(FakeWorker(step_cost=1.0)) as (client, worker):
        async with client.request(TEXT, method="POST", headers={"Content-Type": "application/json"}) as conn:
            await conn.send(json.dumps({"prompt": "x", "max_tokens": 50}).encode())
            await conn.send_complete()
            await trio.sleep(3)  # generating, no response started yet
            await conn.disconnect()
            conn._client_send.close()  # quart-trio's test client hangs on a disconnect unless its send side is closed
        await trio.sleep(2)
    [line] = [
        json.loads(r.getMessage().removeprefix("request ")) for r in caplog.records if r.name == "mlx_trio.requests"
    ]
    assert line["status"] == 499 and line["client_abort"] is True, line
    assert line["finish_reason"] == "abort", line
