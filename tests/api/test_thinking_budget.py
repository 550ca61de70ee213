"""Reasoning budgets through the real server over a tiny model whose template opens a reasoning
block (tests/helpers/thinking.py): a budget of N gives N reasoning tokens, then the forced
`</think>` and separator, then the answer, on chat completions, completions, Responses
(`reasoning.max_tokens`) and Anthropic Messages (`thinking.budget_tokens`, with its 400s),
streamed and whole; batched beside unbudgeted rows, which equal their solo runs; usage reports
the reasoning tokens. The random model never closes its reasoning by itself."""

from __future__ import annotations

import pytest
import trio

from tests.helpers.thinking import post_stream, write_thinking_template
from tests.realserver import CHAT, COMPLETIONS, real_server

LIMIT_S = 180
N = 6
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture()
def template(tmp_path):
    return str(write_thinking_template(tmp_path))


def chat_body(i: int, **extra):
    return {
        "messages": [{"role": "user", "content": f"Question {i}: why is the sky blue?"}],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


async def post(server, path, body):
    response = await server.client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


def close_id(server) -> int:
    return server.tokenizer.encode("</think>", add_special_tokens=False)[0]


async def test_chat_budget_whole_and_streamed(model_dir, template):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template) as server:
            free = await post(server, CHAT, chat_body(0))
            assert free["usage"]["completion_tokens_details"]["reasoning_tokens"] == MAX_TOKENS
            assert not free["choices"][0]["message"].get("content")  # never left its reasoning

            whole = await post(server, CHAT, chat_body(0, thinking_token_budget=N))
            message = whole["choices"][0]["message"]
            assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == N
            assert message["reasoning"] and message["content"]
            rows = server.worker.tokens_by_row()
            cut = rows[max(rows)]
            separator = server.tokenizer.encode("\n\n", add_special_tokens=False)
            assert cut[N] == close_id(server) and cut[N + 1 : N + 1 + len(separator)] == separator
            assert cut[:N] == rows[min(rows)][:N]  # the reasoning is the free run's, up to the budget

            chunks = await post_stream(
                server.client,
                CHAT,
                {**chat_body(0, thinking_token_budget=N), "stream_options": {"include_usage": True}},
            )
            deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if isinstance(c, dict) and c["choices"]]
            reasoning = "".join(d.get("reasoning") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            assert (reasoning, content) == (message["reasoning"], message["content"])
            usage = [c for c in chunks if isinstance(c, dict) and not c["choices"]][0]["usage"]
            assert usage["completion_tokens_details"]["reasoning_tokens"] == N


async def test_budgeted_rows_batched_beside_unbudgeted_ones(model_dir, template):
    bodies = [chat_body(i, thinking_token_budget=2 + i) if i % 2 else chat_body(i) for i in range(6)]
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template, batch=8) as server:
            solo = [await post(server, CHAT, body) for body in bodies]
            together: list = [None] * len(bodies)

            async def one(i: int) -> None:
                together[i] = await post(server, CHAT, bodies[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(bodies)):
                    nursery.start_soon(one, i)
            assert max(server.worker.step_widths()) > 1  # they shared decode steps
            for i, (alone, batched) in enumerate(zip(solo, together)):
                assert batched["choices"][0]["message"] == alone["choices"][0]["message"]
                spent = batched["usage"]["completion_tokens_details"]["reasoning_tokens"]
                assert spent == (2 + i if i % 2 else MAX_TOKENS)


async def test_completions_budget_and_server_default(model_dir, template):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template, thinking_budget=3) as server:
            prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
            whole = await post(
                server, COMPLETIONS, {"prompt": prompt, "max_tokens": MAX_TOKENS, "thinking_token_budget": N}
            )
            assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == N
            assert "</think>\n\n" in whole["choices"][0]["text"]
            # --thinking-budget: the default of a request that sets none
            chat = await post(server, CHAT, chat_body(1))
            assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
            # a request with thinking off neither reasons nor reports reasoning tokens
            off = await post(server, CHAT, chat_body(1, chat_template_kwargs={"enable_thinking": False}))
            assert "completion_tokens_details" not in off["usage"]


async def test_responses_reasoning_max_tokens(model_dir, template):
    body = {"input": "Why is the sky blue?", "max_output_tokens": MAX_TOKENS, "reasoning": {"max_tokens": N}}
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, chat_template=template) as server:
            whole = await post(server, "/v1/responses", body)
            assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == N
            assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
            events = await post_stream(server.client, "/v1/responses", body)
            ends = ("response.completed", "response.incomplete")  # (max_output_tokens may cut the answer)
            done = [payload for name, payload in events if name in ends][0]["response"]
            assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == N
            assert done["output"][1]["content"][0]["text"] == whole["output"][1]["content"][0]["text"]
            response = await server.client.post("/v1/responses", json={**body, "reasoning": {"max_tokens": -1}})
            assert response.status_code == 400
            assert (await response.get_json())["error"]["param"] == "reasoning.max_tokens"


@pytest.fixture(scope="module")
def patient_model_dir(tiny_model_factory):
    """Weights whose greedy reasoning on this prompt runs past 1100 tokens without closing."""
    return tiny_model_factory("qwen3", seed=4)


async def test_anthropic_budget_tokens(patient_model_dir, template):
    budget = 1024
    body = {
        "max_tokens": budget + 8,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "thinking": {"type": "enabled", "budget_tokens": budget},
    }
    with trio.fail_after(LIMIT_S):
        async with real_server(patient_model_dir, chat_template=template) as server:
            whole = await post(server, "/v1/messages", body)
            # (the random model may open another block in its answer: only the first is budgeted)
            assert [block["type"] for block in whole["content"]][:2] == ["thinking", "text"]
            tokens = next(iter(server.worker.tokens_by_row().values()))
            assert tokens.index(close_id(server)) == budget
            events = await post_stream(server.client, "/v1/messages", body)
            kinds = [p["content_block"]["type"] for name, p in events if name == "content_block_start"]
            assert kinds[:2] == ["thinking", "text"]

            for thinking, max_tokens, param in (
                ({"type": "enabled", "budget_tokens": 1023}, 4096, "thinking"),
                ({"type": "enabled", "budget_tokens": 2048}, 2048, "max_tokens"),
            ):
                response = await server.client.post(
                    "/v1/messages", json={**body, "thinking": thinking, "max_tokens": max_tokens}
                )
                assert response.status_code == 400
                error = (await response.get_json())["error"]
                assert error["type"] == "invalid_request_error" and "budget_tokens" in error["message"], param
