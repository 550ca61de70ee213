"""Request validation on the OpenAI routes: every invalid field is a
400 with the documented message in the OpenAI error shape, and no input at all gives a 500.
Valid fields reach the row's SamplingParams and the chat template as the spec maps them.

Real actors (admission, scheduler, request) over a FakeWorker, through quart-trio's test client,
under the autojump clock.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.fields import REASONING_EFFORT_MESSAGE
from model.engine.params import SamplingParams
from tests.fakes import FakeTokenizer, FakeWorker, token_text

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
VOCAB = 1000


class RecordingTokenizer(FakeTokenizer):
    """FakeTokenizer that remembers what the template was asked to render, with a vocabulary."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.rendered: list[dict[str, Any]] = []

    def decode(self, ids, *, skip_special_tokens=False):
        return "".join(token_text(t) for t in ids)

    def render_chat(self, messages, *, tools=None, add_generation_prompt=True, **kw):
        if add_generation_prompt:  # the prompt (a cache breakpoint's cut renders without one)
            self.rendered.append({"messages": messages, "tools": tools, "kwargs": kw})
        return super().render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw)


@asynccontextmanager
async def server(sampling_defaults: SamplingParams = SamplingParams(), **config):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    tokenizer = RecordingTokenizer()
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            worker,
            options=serve_options(**config),
            make_tokenizer=lambda info: tokenizer,
            sampling_defaults=sampling_defaults,
        )
        yield create_app(handles).test_client(), worker, tokenizer
        nursery.cancel_scope.cancel()


def frames(body: bytes) -> list[str]:
    return [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f]


async def error_of(response) -> dict:
    assert response.content_type == "application/json"
    body = await response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def chat(**fields) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


# (route, body, message substring, param)
INVALID = [
    # sampling
    (CHAT, chat(temperature="hot"), "temperature must be a non-negative float", "temperature"),
    (CHAT, chat(temperature=-0.5), "temperature must be a non-negative float", "temperature"),
    (CHAT, chat(top_p=1.5), "top_p must be a float between 0 and 1", "top_p"),
    (CHAT, chat(top_k=2.5), "top_k must be a non-negative integer", "top_k"),
    (CHAT, chat(top_k=-3), "top_k must be a non-negative integer", "top_k"),
    (CHAT, chat(top_k="5"), "top_k must be a non-negative integer", "top_k"),
    (CHAT, chat(min_p=2), "min_p must be a float between 0 and 1", "min_p"),
    (CHAT, chat(xtc_probability=1.5), "xtc_probability must be a float between 0.0 and 1.0", "xtc_probability"),
    (CHAT, chat(xtc_threshold=-0.1), "xtc_threshold must be a float between 0.0 and 1.0", "xtc_threshold"),
    (CHAT, chat(seed="7"), "seed must be an integer", "seed"),
    (CHAT, chat(seed=1.5), "seed must be an integer", "seed"),
    # penalties and their context sizes
    (CHAT, chat(repetition_penalty=-1), "repetition_penalty must be a non-negative float", "repetition_penalty"),
    (CHAT, chat(presence_penalty="x"), "presence_penalty must be a float", "presence_penalty"),
    (CHAT, chat(frequency_penalty=[1]), "frequency_penalty must be a float", "frequency_penalty"),
    (
        CHAT,
        chat(repetition_context_size=-1),
        "repetition_context_size must be a non-negative integer",
        "repetition_context_size",
    ),
    (
        CHAT,
        chat(presence_context_size=2.5),
        "presence_context_size must be a non-negative integer",
        "presence_context_size",
    ),
    (
        CHAT,
        chat(frequency_context_size="20"),
        "frequency_context_size must be a non-negative integer",
        "frequency_context_size",
    ),
    # logit_bias
    (CHAT, chat(logit_bias=[1, 2]), "logit_bias must be a dict of int to float", "logit_bias"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias must be a dict of int to float", "logit_bias"),
    (CHAT, chat(logit_bias={"5": "strong"}), "logit_bias must be a dict of int to float", "logit_bias"),
    (CHAT, chat(logit_bias={"5": None}), "logit_bias must be a dict of int to float", "logit_bias"),
    (CHAT, chat(logit_bias={"5": True}), "logit_bias must be a dict of int to float", "logit_bias"),
    (CHAT, chat(logit_bias={"-1": 1}), "logit_bias token id -1 is out of range", "logit_bias"),
    (CHAT, chat(logit_bias={str(VOCAB): 1}), f"logit_bias token id {VOCAB} is out of range", "logit_bias"),
    (TEXT, {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias must be a dict of int to float", "logit_bias"),
    # length, stop, stream
    (CHAT, chat(max_tokens=0), "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, chat(max_tokens="5"), "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens must be a positive integer", "max_completion_tokens"),
    (TEXT, {"prompt": "x", "max_tokens": 1.5}, "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, chat(stop=5), "stop must be a string or an array of strings", "stop"),
    (CHAT, chat(stop={"a": 1}), "stop must be a string or an array of strings", "stop"),
    (CHAT, chat(stop=[5]), "stop must be a string or an array of strings", "stop"),
    (CHAT, chat(stop=["ok", None]), "stop must be a string or an array of strings", "stop"),
    (TEXT, {"prompt": "x", "stop": ["ok", 5]}, "stop must be a string or an array of strings", "stop"),
    (CHAT, chat(stream="yes"), "stream must be a boolean", "stream"),
    # logprobs: mlx_lm's messages and cap 11 on chat; OpenAI's rule that top_logprobs needs logprobs
    (CHAT, chat(logprobs=5), "logprobs must be of type bool", "logprobs"),
    (CHAT, chat(logprobs="true"), "logprobs must be of type bool", "logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs requires logprobs: true", "top_logprobs"),
    (CHAT, chat(logprobs=False, top_logprobs=2), "top_logprobs requires logprobs: true", "top_logprobs"),
    # /v1/completions: the legacy API's integer (alternatives per token); chat's boolean is not it
    (TEXT, {"prompt": "x", "logprobs": True}, "logprobs must be an integer from 0 to 11", "logprobs"),
    (TEXT, {"prompt": "x", "logprobs": False}, "logprobs must be an integer from 0 to 11", "logprobs"),
    (TEXT, {"prompt": "x", "logprobs": -1}, "logprobs must be an integer from 0 to 11", "logprobs"),
    (TEXT, {"prompt": "x", "logprobs": 12}, "logprobs must be an integer from 0 to 11", "logprobs"),
    (TEXT, {"prompt": "x", "logprobs": "2"}, "logprobs must be an integer from 0 to 11", "logprobs"),
    (
        TEXT,
        {"prompt": "x", "logprobs": 2, "top_logprobs": 2},
        "top_logprobs is a chat completions field",
        "top_logprobs",
    ),
    (TEXT, {"prompt": "x", "echo": "yes"}, "echo must be a boolean", "echo"),
    (
        TEXT,
        {"prompt": "x", "return_tokens_as_token_ids": 1},
        "return_tokens_as_token_ids must be a boolean",
        "return_tokens_as_token_ids",
    ),
    # prompt logprobs need a worker that scores prompts (the fake one does not)
    (TEXT, {"prompt": "x", "echo": True, "logprobs": 1}, "prompt logprobs (echo with logprobs) are not", "echo"),
    (TEXT, {"prompt": "x", "echo": True, "max_tokens": 0}, "max_tokens must be a positive integer", "max_tokens"),
    (TEXT, {"prompt": "x", "logprobs": 1, "max_tokens": 0}, "max_tokens must be a positive integer", "max_tokens"),
    (CHAT, chat(top_logprobs="3"), "top_logprobs must be of type int", "top_logprobs"),
    (CHAT, chat(top_logprobs=2.5), "top_logprobs must be of type int", "top_logprobs"),
    (CHAT, chat(top_logprobs=True), "top_logprobs must be of type int", "top_logprobs"),
    (CHAT, chat(top_logprobs=-2), "top_logprobs must be at least 0", "top_logprobs"),
    (CHAT, chat(top_logprobs=12), "top_logprobs must be at most 11", "top_logprobs"),
    (TEXT, {"prompt": "x", "top_logprobs": 3}, "top_logprobs is a chat completions field", "top_logprobs"),
    # reasoning / template kwargs
    (CHAT, chat(reasoning_effort="hihg"), REASONING_EFFORT_MESSAGE, "reasoning_effort"),
    (CHAT, chat(reasoning_effort="HIGH"), REASONING_EFFORT_MESSAGE, "reasoning_effort"),
    (CHAT, chat(reasoning_effort=3), REASONING_EFFORT_MESSAGE, "reasoning_effort"),
    (CHAT, chat(reasoning_effort=True), REASONING_EFFORT_MESSAGE, "reasoning_effort"),
    (CHAT, chat(chat_template_kwargs="x"), "chat_template_kwargs must be an object", "chat_template_kwargs"),
    (
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": "yes"}),
        "chat_template_kwargs.enable_thinking must be a boolean",
        "chat_template_kwargs",
    ),
    (
        CHAT,
        chat(chat_template_kwargs={"preserve_thinking": 1}),
        "chat_template_kwargs.preserve_thinking must be a boolean",
        "chat_template_kwargs",
    ),
    # tools
    (CHAT, chat(tools="get_weather"), "tools must be an array of tool definitions", "tools"),
    (CHAT, chat(tools=[1]), "tools[0] must be an object", "tools"),
    (CHAT, chat(tools=[{"type": "function"}]), 'tools[0] must be {"type": "function"', "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools[0] must be", "tools"),
    (CHAT, chat(tool_choice=5), "tool_choice must be 'none', 'auto', 'required' or an object", "tool_choice"),
    (CHAT, chat(tool_choice="sometimes"), "tool_choice must be", "tool_choice"),
    (CHAT, chat(tool_choice="required"), "tool_choice requires tools", "tool_choice"),
    (CHAT, chat(tool_choice="required", tools=[]), "tool_choice requires tools", "tool_choice"),
    (
        CHAT,
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        "tool_choice requires tools",
        "tool_choice",
    ),
    # messages
    (CHAT, {"max_tokens": 2}, "messages required", "messages"),
    (CHAT, chat(messages=[]), "messages required", "messages"),
    (CHAT, chat(messages="hi"), "messages required", "messages"),
    (CHAT, chat(messages=["hi"]), "messages[0] must be an object", "messages"),
    (CHAT, chat(messages=[{"content": "hi"}]), "messages[0].role must be one of", "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role must be one of", "messages"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content is required", "messages"),
    (CHAT, chat(messages=[*USER, {"role": "assistant"}]), "messages[1].content is required", "messages"),
    (
        CHAT,
        chat(messages=[*USER, {"role": "tool", "tool_call_id": "c"}]),
        "messages[1].content is required",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        "messages[0].content must be a string or an array",
        "messages",
    ),
    (CHAT, chat(messages=[{"role": "user", "content": [5]}]), "parts must be objects", "messages"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "image_url content parts are not supported",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
        "input_audio content parts are not supported",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]),
        "video_url content parts are not supported",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "mystery"}]}]),
        "unsupported content part type 'mystery'",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages[0].content text parts need a string 'text'",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
        "tool_calls is only allowed on assistant messages",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[*USER, {"role": "assistant", "tool_calls": {"a": 1}}]),
        "messages[1].tool_calls must be an array",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"function": {}}]}]),
        "messages[1].tool_calls[0] must be",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[*USER, {"role": "tool", "tool_call_id": 5, "content": "x"}]),
        "messages[1].tool_call_id must be a string",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[*USER, {"role": "tool", "content": "x"}]),
        "messages[1].tool_call_id is required",
        "messages",
    ),
    (
        CHAT,
        chat(messages=[*USER, {"role": "tool", "tool_call_id": None, "content": "x"}]),
        "messages[1].tool_call_id is required",
        "messages",
    ),
    (CHAT, chat(parallel_tool_calls="no"), "parallel_tool_calls must be a boolean", "parallel_tool_calls"),
    (CHAT, chat(messages=[{"role": "user", "content": "RAISE"}]), "prompt build failed", None),
    # /v1/completions prompt
    (TEXT, {"prompt": ""}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {"prompt": []}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
    (TEXT, {"prompt": [1, 2.5]}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {"prompt": [1, True]}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {"prompt": 42}, "prompt (a non-empty string)", "prompt"),
    (TEXT, {"prompt": [5, VOCAB]}, f"prompt token id {VOCAB} is out of range", "prompt"),
    # /v1/completions fields the server cannot honour
    (TEXT, {"prompt": "x", "suffix": "end"}, "suffix is not supported", "suffix"),
    (TEXT, {"prompt": "x", "suffix": 5}, "suffix is not supported", "suffix"),
    (TEXT, {"prompt": "x", "best_of": 2}, "best_of is not supported", "best_of"),
    (TEXT, {"prompt": "x", "best_of": 3, "n": 2}, "best_of is not supported", "best_of"),
    (TEXT, {"prompt": "x", "best_of": 0}, "best_of must be a positive integer", "best_of"),
    (TEXT, {"prompt": "x", "best_of": "2"}, "best_of must be a positive integer", "best_of"),
]


async def test_each_invalid_field_is_the_documented_400(autojump_clock):
    async with server() as (client, worker, _):
        for route, body, message, param in INVALID:
            response = await client.post(route, json=body)
            assert response.status_code == 400, (route, body, await response.get_data())
            error = await error_of(response)
            assert message in error["message"], (body, error)
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert worker.specs == {}  # nothing invalid ever reached the engine


async def test_invalid_json_and_non_object_bodies(autojump_clock):
    async with server() as (client, _, _):
        for route in (CHAT, TEXT):
            for data in (b"{not json", b"[1, 2]", b'"text"', b""):
                response = await client.post(route, data=data, headers={"Content-Type": "application/json"})
                assert response.status_code == 400
                assert (await error_of(response))["message"] == "invalid JSON body"


WEIRD_VALUES = [None, True, False, 0, -1, 1, 2.5, 1e300, -1e300, 2**70, "", "x", "1", [], [1], ["a", 1], {}, {"a": 1}]
FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "xtc_probability",
    "xtc_threshold",
    "seed",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "logit_bias",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "reasoning_effort",
    "n",
    "user",
    "stream_options",
    "response_format",
    "echo",
    "model",
]


async def test_no_field_value_gives_a_500(autojump_clock):
    """Every field × a spread of wrong-typed and edge values: 200 or a 400, never a 500."""
    async with server() as (client, _, _):
        for field in FIELDS:
            for value in WEIRD_VALUES:
                for route, base in ((CHAT, chat()), (TEXT, {"prompt": "x", "max_tokens": 2})):
                    body = {**base, field: value}
                    response = await client.post(route, json=body)
                    # a string `model` that names no served model is a 404 (api/model_names.py)
                    expected = (200, 400, 404) if field == "model" and isinstance(value, str) else (200, 400)
                    assert response.status_code in expected, (route, field, value, response.status_code)
                    if response.status_code == 400:
                        await error_of(response)
                    else:
                        await response.get_data()  # drain a stream
        for messages in (
            [{"role": "user", "content": None}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "assistant", "content": None}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}],
            [{"role": "tool", "content": [{"type": "text", "text": "r"}]}],
            [{"role": "user", "content": "x", "name": {"weird": True}}],
        ):
            response = await client.post(CHAT, json=chat(messages=messages))
            assert response.status_code in (200, 400), (messages, response.status_code)


async def test_valid_fields_reach_the_row_sampling_params(autojump_clock):
    async with server() as (client, worker, _):
        body = chat(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            xtc_probability=0.5,
            xtc_threshold=0.2,
            repetition_penalty=1.1,
            repetition_context_size=30,
            presence_penalty=-0.5,
            presence_context_size=10,
            frequency_penalty=0.25,
            frequency_context_size=5,
            logit_bias={"7": -100, "3": 2.5, "07": 1},
            logprobs=True,
            top_logprobs=4,
            max_completion_tokens=3,
            max_tokens=9,
        )
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200
        [spec] = worker.specs.values()
        p = spec.sampling
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 40, 0.05)
        assert (p.xtc_probability, p.xtc_threshold) == (0.5, 0.2)
        assert (p.repetition_penalty, p.repetition_context_size) == (1.1, 30)
        assert (p.presence_penalty, p.presence_context_size) == (-0.5, 10)
        assert (p.frequency_penalty, p.frequency_context_size) == (0.25, 5)
        assert p.logit_bias == ((3, 2.5), (7, 1.0))  # string keys coerced; "07" and "7" are one id
        assert (p.logprobs, p.top_logprobs) == (True, 4)
        assert spec.max_tokens == 3  # max_completion_tokens wins over max_tokens


async def test_streams_capture_logprobs_and_top_k_minus_one_is_off(autojump_clock):
    async with server() as (client, worker, _):
        await (await client.post(CHAT, json=chat(stream=True, logprobs=True, top_logprobs=3, top_k=-1))).get_data()
        await (await client.post(CHAT, json=chat(top_logprobs=-1))).get_data()
        first, second = worker.specs.values()
        assert (first.sampling.logprobs, first.sampling.top_logprobs, first.sampling.top_k) == (True, 3, 0)
        assert (second.sampling.logprobs, second.sampling.top_logprobs) == (False, 0)


async def test_completions_logprobs_is_the_legacy_integer_and_streams_capture_it(autojump_clock):
    async with server() as (client, worker, _):
        for fields in ({"logprobs": 3}, {"logprobs": 0}, {"logprobs": 3, "stream": True}, {"logprobs": None}):
            response = await client.post(TEXT, json={"prompt": "x", "max_tokens": 2, **fields})
            assert response.status_code == 200
            if not fields.get("stream"):
                [choice] = (await response.get_json())["choices"]
                # (the fake worker reports no logprobs: an empty block, in the legacy shape)
                empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                assert choice["logprobs"] == (None if fields["logprobs"] is None else empty)
            else:
                await response.get_data()
        sampling = [(spec.sampling.logprobs, spec.sampling.top_logprobs) for spec in worker.specs.values()]
        assert sampling == [(True, 3), (True, 0), (True, 3), (False, 0)]


async def test_completions_echo_prepends_the_prompt(autojump_clock):
    async with server(batch=4) as (client, _, _):
        plain = await (await client.post(TEXT, json={"prompt": "Say", "max_tokens": 3})).get_json()
        said = plain["choices"][0]["text"]
        echoed = await client.post(TEXT, json={"prompt": "Say", "max_tokens": 3, "echo": True, "n": 2})
        assert [c["text"] for c in (await echoed.get_json())["choices"]] == ["Say" + said] * 2
        assert (await echoed.get_json())["usage"]["completion_tokens"] == 6  # echo adds no tokens
        body = {"prompt": "Say", "max_tokens": 3, "echo": True, "stream": True}
        data = [json.loads(f) for f in frames(await (await client.post(TEXT, json=body)).get_data())[:-1]]
        assert data[0]["choices"][0]["text"] == "Say"  # the first chunk is the prompt
        assert "".join(c["choices"][0]["text"] for c in data) == "Say" + said
        by_ids = {"prompt": [5, 6], "max_tokens": 1, "echo": True}
        text = (await (await client.post(TEXT, json=by_ids)).get_json())["choices"][0]["text"]
        assert text.startswith("t5 t6 ")  # token ids: their decoded text
        off = await (await client.post(TEXT, json={"prompt": "Say", "max_tokens": 3, "echo": False})).get_json()
        assert off["choices"][0]["text"] == said


async def test_length_defaults_per_route(autojump_clock):
    async with server() as (client, worker, _):
        await (await client.post(TEXT, json={"prompt": "x"})).get_data()
        await (await client.post(CHAT, json={"messages": USER})).get_data()
        text, chat_row = worker.specs.values()
        assert text.max_tokens == 512  # mlx_lm.server's default for untemplated prompts
        assert chat_row.max_tokens == 4096 - len(chat_row.prompt)  # 65 536, clamped to the context left
    async with server(max_tokens=7) as (client, worker, _):
        await (await client.post(TEXT, json={"prompt": "x"})).get_data()
        await (await client.post(CHAT, json={"messages": USER, "max_tokens": 3})).get_data()
        assert [spec.max_tokens for spec in worker.specs.values()] == [7, 3]  # request > --max-tokens


async def test_request_beats_server_defaults_field_by_field(autojump_clock):
    hot = SamplingParams(temperature=0.9, top_p=0.8, top_k=20)
    async with server(sampling_defaults=hot) as (client, worker, _):
        assert (await client.post(CHAT, json=chat(top_p=0.5))).status_code == 200
        [spec] = worker.specs.values()
        assert (spec.sampling.temperature, spec.sampling.top_p, spec.sampling.top_k) == (0.9, 0.5, 20)


async def test_no_think_turn_caps_a_hot_default_temperature(autojump_clock):
    hot = SamplingParams(temperature=1.0)
    async with server(sampling_defaults=hot) as (client, worker, _):
        for fields in (
            {"reasoning_effort": "none"},
            {},
            {"reasoning_effort": "none", "temperature": 1.2},
            {"chat_template_kwargs": {"enable_thinking": False}},
        ):
            assert (await client.post(CHAT, json=chat(**fields))).status_code == 200
        temperatures = [spec.sampling.temperature for spec in worker.specs.values()]
        assert temperatures == [0.7, 1.0, 1.2, 0.7]  # an explicit temperature is never capped


async def test_messages_are_normalized_before_templating(autojump_clock):
    async with server() as (client, _, tokenizer):
        messages = [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c"]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "42"}]},
            {"role": "user", "content": None},
        ]
        original = json.loads(json.dumps(messages))
        assert (await client.post(CHAT, json=chat(messages=messages))).status_code == 200
        rendered = tokenizer.rendered[-1]["messages"]
        assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool", "user"]
        assert rendered[1]["content"] == "abc" and rendered[3]["content"] == "42" and rendered[4]["content"] == ""
        calls = rendered[2]["tool_calls"]
        assert calls[0]["function"]["arguments"] == {"x": 1}  # parsed before templating
        assert calls[1]["function"]["arguments"] == "not json"  # left as the client sent it
        assert rendered[2]["content"] is None
        assert messages == original  # the request body is never mutated


@pytest.mark.parametrize(
    ("fields", "tools", "kwargs"),
    [
        ({}, None, {}),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            [{"type": "function", "function": {"name": "f"}}],
            {},
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None, {}),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            [{"type": "function", "function": {"name": "f"}}],
            {},
        ),
        ({"tools": []}, None, {}),
        ({"reasoning_effort": "none"}, None, {"enable_thinking": False}),
        ({"reasoning_effort": "xhigh"}, None, {"enable_thinking": True}),
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
            None,
            {"enable_thinking": False},
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": True, "preserve_thinking": False, "other": 1}},
            None,
            {"enable_thinking": True, "preserve_thinking": False, "other": 1},  # any variable passes through
        ),
    ],
)
async def test_tools_and_thinking_reach_the_template(autojump_clock, fields, tools, kwargs):
    async with server() as (client, _, tokenizer):
        assert (await client.post(CHAT, json=chat(**fields))).status_code == 200
        rendered = tokenizer.rendered[-1]
        assert rendered["tools"] == tools and rendered["kwargs"] == kwargs


def test_legacy_logprobs_block():
    from api.openai.encode import MASKED_LOGPROB, TokenNames, legacy_logprobs
    from model.engine.rows import TokenOut, TopLogprob

    outs = [
        TokenOut(1, 7, logprob=-0.5, top_logprobs=(TopLogprob(7, -0.5), TopLogprob(9, -1.5))),
        TokenOut(1, 12, logprob=-2.0, top_logprobs=(TopLogprob(3, -0.1), TopLogprob(4, float("-inf")))),
        TokenOut(1, 5, logprob=-0.25),  # logprobs: 0, the sampled token alone
    ]
    block, offset = legacy_logprobs(outs, TokenNames(RecordingTokenizer()), offset=10)
    assert block == {
        "tokens": ["t7 ", "t12 ", "t5 "],
        "token_logprobs": [-0.5, -2.0, -0.25],
        # the alternatives (most likely first, a masked one at OpenAI's floor), then the sampled token
        "top_logprobs": [
            {"t7 ": -0.5, "t9 ": -1.5},
            {"t3 ": -0.1, "t4 ": MASKED_LOGPROB, "t12 ": -2.0},
            {"t5 ": -0.25},
        ],
        "text_offset": [10, 13, 17],
    }
    assert offset == 20
    # vLLM's return_tokens_as_token_ids: the same block, tokens named by id (offsets still count text)
    by_id, _ = legacy_logprobs(outs[1:2], TokenNames(RecordingTokenizer(), as_ids=True), offset=10)
    assert by_id["tokens"] == ["token_id:12"] and by_id["text_offset"] == [10]
    assert by_id["top_logprobs"] == [{"token_id:3": -0.1, "token_id:4": MASKED_LOGPROB, "token_id:12": -2.0}]


async def test_loose_but_valid_chat_bodies_still_pass(autojump_clock):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "f"}}]
    async with server() as (client, _, _):
        for body in (
            chat(
                messages=[
                    *USER,
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "1"},
                ],
                parallel_tool_calls=False,
            ),
            chat(messages=[{"role": "user", "content": None}]),  # null is empty text (mlx_lm.server)
            chat(stop=["", "x"]),
            chat(tools=tools, tool_choice="required"),
            chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}),
            chat(logprobs=True, top_logprobs=2),
            chat(top_logprobs=0),
        ):
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, (body, await response.get_data())
        for text_body in (
            {"prompt": "x", "max_tokens": 2, "suffix": None, "best_of": None},
            {"prompt": "x", "max_tokens": 2, "suffix": "", "best_of": 1},  # nothing to insert, one candidate
        ):
            response = await client.post(TEXT, json=text_body)
            assert response.status_code == 200, (text_body, await response.get_data())
