"""The small endpoints beside generation, on the real server over a tiny model: /tokenize,
/detokenize, /apply-template, GET /v1, GET /fit, and prompt logprobs on /v1/completions
(`echo` with `logprobs`), which must equal mlx-lm's forward of the prompt (log-softmax)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import trio
from mlx_lm.utils import load_model as mlx_lm_load_model

from tests.realserver import COMPLETIONS, JSON, real_server, sse_payloads

LIMIT_S = 120
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


async def post(server, path, body, headers=None):
    response = await server.client.post(path, json=body, headers=headers)
    return response.status_code, await response.get_json()


async def test_tokenize_detokenize_and_apply_template_match_the_tokenizer(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            tokenizer = server.tokenizer
            status, body = await post(server, "/tokenize", {"model": "", "prompt": "Hello there, world"})
            assert status == 200
            assert body["tokens"] == tokenizer.encode("Hello there, world")
            assert body["count"] == len(body["tokens"])
            assert body["max_model_len"] == server.handles.info.context_length

            status, body = await post(server, "/tokenize", {"prompt": "Hi", "return_token_strs": True})
            assert body["token_strs"] == [tokenizer.id_to_token(t) for t in tokenizer.encode("Hi")]

            rendered = tokenizer.render_chat(MESSAGES, tools=TOOLS, add_generation_prompt=True)
            status, body = await post(server, "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
            assert status == 200 and body["tokens"] == tokenizer.encode(rendered)

            status, body = await post(server, "/apply-template", {"messages": MESSAGES, "tools": TOOLS})
            assert status == 200 and body == {"prompt": rendered}
            status, body = await post(server, "/apply-template", {"messages": MESSAGES, "add_generation_prompt": False})
            assert body["prompt"] == tokenizer.render_chat(MESSAGES, add_generation_prompt=False)

            ids = tokenizer.encode("Round trip, intact.")
            status, body = await post(server, "/detokenize", {"tokens": ids})
            assert status == 200 and body == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/apply-template", {"messages": [{"role": "pilot", "content": "x"}]}, "messages"),
        ("/apply-template", {"messages": MESSAGES, "chat_template_kwargs": 3}, "chat_template_kwargs"),
    ],
)
async def test_bad_utility_bodies_are_400s_naming_the_field(model_dir, path, body, param):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            status, answer = await post(server, path, body)
            assert status == 400, answer
            assert answer["error"]["param"] == param


async def test_index_and_fit_answer(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=4) as server:
            status, index = await post(server, COMPLETIONS, {"prompt": "warm", "max_tokens": 3})
            assert status == 200
            response = await server.client.get("/v1")
            index = await response.get_json()
            assert index["name"] == "mlx-trio-server" and index["model"] == server.handles.info.name
            assert {"POST /tokenize", "GET /fit", "POST /v1/chat/completions", "GET /v1"} <= set(index["endpoints"])

            fit = await (await server.client.get("/fit")).get_json()
            info, ceiling = server.handles.info, server.handles.ceiling
            assert fit["machine"]["device"] == info.device and fit["machine"]["bandwidth_gbs"] > 0
            assert fit["model"]["weights_bytes"] == info.weights_bytes
            assert fit["model"]["kv_bytes_per_token"] == info.kv_bytes_per_token
            assert fit["model"]["max_safe_context"] == ceiling.max_safe_context
            assert fit["model"]["batch_rows"] == 4
            assert 0 < fit["model"]["max_context_per_row_in_full_batch"] <= ceiling.max_safe_context
            predicted = fit["decode"]["predicted"]
            assert predicted["batch_tok_s"] > predicted["row_tok_s"] > 0
            measured = fit["decode"]["measured"]
            assert measured["steps"] >= 1 and measured["row_tok_s"] > 0


def reference_logprobs(model_dir, tokens: list[int]) -> list[float]:
    model, _ = mlx_lm_load_model(model_dir)
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [float(logprobs[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]


async def test_prompt_logprobs_equal_mlx_lm_forward(model_dir):
    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, prefill_chunk=8) as server:  # several chunks per prompt
            tokens = server.tokenizer.encode(prompt)
            expected = reference_logprobs(model_dir, tokens)
            body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 4}
            status, whole = await post(server, COMPLETIONS, body)
            assert status == 200, whole
            choice = whole["choices"][0]
            block = choice["logprobs"]
            assert choice["text"].startswith(prompt)
            assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
            scored = block["token_logprobs"][1 : len(tokens)]
            assert scored == pytest.approx(expected, abs=1e-3)
            for top in block["top_logprobs"][1 : len(tokens)]:
                assert 2 <= len(top) <= 3
            assert len(block["tokens"]) == len(tokens) + whole["usage"]["completion_tokens"]
            offsets = block["text_offset"]
            assert offsets == sorted(offsets) and offsets[len(tokens)] >= len(prompt) - 1

            # max_tokens 0: the prompt's scores alone, streamed the same
            status, only = await post(server, COMPLETIONS, {**body, "max_tokens": 0})
            assert status == 200 and only["usage"]["completion_tokens"] == 0
            assert only["choices"][0]["text"] == prompt and only["choices"][0]["finish_reason"] == "length"
            assert only["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)
            streamed = await stream_body(server, {**body, "max_tokens": 0})
            assert streamed[0]["choices"][0]["logprobs"] == only["choices"][0]["logprobs"]

            # streamed with generation: the echo chunk carries the prompt's scores
            chunks = await stream_body(server, body)
            first = chunks[0]["choices"][0]
            assert first["text"] == prompt
            assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)


async def stream_body(server, body):
    response = await server.client.post(COMPLETIONS, json={**body, "stream": True}, headers=JSON)
    assert response.status_code == 200
    return [p for p in sse_payloads(await response.get_data()) if p != "[DONE]"]


async def test_utilities_take_the_api_key(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, api_key="sekrit") as server:
            status, _ = await post(server, "/tokenize", {"prompt": "x"})
            assert status == 401
            status, body = await post(server, "/tokenize", {"prompt": "x"}, {"Authorization": "Bearer sekrit"})
            assert status == 200 and body["count"] >= 1
            assert (await server.client.get("/fit")).status_code == 200  # open, like /stats
            assert (await server.client.get("/v1")).status_code == 401  # /v1 as every /v1 path
            keyed = await server.client.get("/v1", headers={"x-api-key": "sekrit"})
            assert json.loads(await keyed.get_data())["object"] == "server"
