"""OpenAI's `n` end to end on the real engine (tiny random model, CPU): n choices from one
prefill, each its own row; and the `stream_options.include_usage` chunk. The real server runs in
process (tests/realserver.py); the engine's own prefill counter says how often a prompt was
forwarded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.realserver import CHAT, COMPLETIONS, JSON, RealServer, real_server, sse_payloads, wait_until

openai = pytest.importorskip("openai")

LIMIT_S = 120
MESSAGES = [{"role": "user", "content": "Once upon a time in a small village by the sea there lived"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


async def prefilled(server: RealServer) -> int:
    return int(await server.worker.inner.run_exclusive(lambda engine: engine.prefill_tokens))


async def post(server: RealServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body), or for a stream (200, its payloads) read as they arrive (the test
    client's `post` buffers only a few body chunks before the app blocks)."""
    if not body.get("stream"):
        response = await server.client.post(path, json=body)
        return response.status_code, json.loads(await response.get_data())
    async with server.client.request(path, method="POST", headers=JSON) as conn:
        await conn.send(json.dumps(body).encode())
        await conn.send_complete()
        data = b""
        while not data.endswith(b"data: [DONE]\n\n"):
            try:
                data += await conn.receive()
            except trio.EndOfChannel:
                break
        if conn.status_code != 200:
            return conn.status_code, json.loads(data)
    return 200, sse_payloads(data)


async def test_three_greedy_choices_equal_one_and_share_one_prefill(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
            status, one = await post(server, CHAT, body)
            assert status == 200
            before = await prefilled(server)
            status, three = await post(server, CHAT, {**body, "n": 3})
            assert status == 200
            prompt = server.tokenizer.encode_chat(MESSAGES)
            assert await prefilled(server) - before == len(prompt) - 1  # the prompt went forward once
            await wait_until(server.worker.settled)
            opens = [c for c in server.worker.calls if c.name == "open_row"]
            forks = [c for c in server.worker.calls if c.name == "fork_rows"]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in three["choices"]]
    assert texts == [one["choices"][0]["message"]["content"]] * 3 and texts[0]
    assert [c["finish_reason"] for c in three["choices"]] == ["length"] * 3
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] == len(prompt)
    assert three["usage"]["completion_tokens"] == 3 * 12
    assert three["usage"]["total_tokens"] == len(prompt) + 36
    assert len(opens) == 2 and len(forks) == 1 and len(forks[0].result) == 2  # n=1, then n=3's leader


async def test_sampled_choices_differ(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 1.0, "n": 4}
            status, result = await post(server, COMPLETIONS, body)
            seeded = [(await post(server, COMPLETIONS, {**body, "seed": 5}))[1] for _ in range(2)]
    assert status == 200 and len(result["choices"]) == 4
    assert len({c["text"] for c in result["choices"]}) > 1
    # an explicit seed: choice i draws from seed + i, so the request repeats and its choices differ
    assert [c["text"] for c in seeded[0]["choices"]] == [c["text"] for c in seeded[1]["choices"]]
    assert len({c["text"] for c in seeded[0]["choices"]}) > 1


async def test_streamed_choices_carry_their_index_and_each_finish(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            status, one = await post(server, CHAT, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
            body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "n": 2, "stream": True}
            status, frames = await post(server, CHAT, body)
            _, text_frames = await post(
                server, COMPLETIONS, {"prompt": "the quick", "max_tokens": 5, "n": 2, "stream": True}
            )
    assert status == 200 and frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage at all
    content = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in chunks:
        [choice] = chunk["choices"]
        content[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
            assert choice["delta"] == {}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert content[0] == content[1] == one["choices"][0]["message"]["content"]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    text_finishes = [c["choices"][0]["index"] for c in text_frames[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(text_finishes) == [0, 1]


async def test_include_usage_ends_the_stream_with_a_usage_chunk_the_sdk_reads(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            options = {"stream": True, "stream_options": {"include_usage": True}}
            body = {"messages": MESSAGES, "max_tokens": 6, "n": 2, **options}
            _, frames = await post(server, CHAT, body)
            _, text = await post(server, COMPLETIONS, {"prompt": "once", "max_tokens": 3, **options})
            _, whole = await post(server, CHAT, {"messages": MESSAGES, "max_tokens": 6, "n": 2})
    chunks = frames[:-1]
    final = chunks[-1]
    assert final["choices"] == [] and final["object"] == "chat.completion.chunk"
    assert (
        final["usage"]["completion_tokens"] == 12
        and final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 12
    )
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's null on every other chunk
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[-1].usage is not None and parsed[-1].usage.completion_tokens == 12
    assert text[-2]["choices"] == [] and text[-2]["usage"]["completion_tokens"] == 3
    openai.types.Completion.model_validate(text[-2])
    sdk_whole = openai.types.chat.ChatCompletion.model_validate(whole)
    assert [c.index for c in sdk_whole.choices] == [0, 1] and sdk_whole.usage.completion_tokens == 12


async def test_bad_n_is_a_400_in_the_openai_shape(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=4) as server:
            for path, base in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})):
                for n in (0, -1, 129, "2", 2.5, True, [2]):
                    status, body = await post(server, path, {**base, "n": n})
                    assert status == 400, (path, n, body)
                    assert body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"
                    assert "n must be an integer from 1 to 128" in body["error"]["message"]
                status, body = await post(server, path, {**base, "n": 5})  # more than the batch's rows
                assert status == 400 and body["error"]["param"] == "n" and "at most 4" in body["error"]["message"]
                status, body = await post(server, path, {**base, "stream_options": {"include_usage": "yes"}})
                assert status == 400 and body["error"]["param"] == "stream_options"
            status, ok = await post(server, CHAT, {"messages": MESSAGES, "max_tokens": 2, "n": 4})
            assert status == 200 and len(ok["choices"]) == 4
            await wait_until(server.worker.settled)
            assert server.handles.scheduler.counters.forked_rows == 3


async def test_a_disconnect_mid_stream_frees_every_choices_row(model_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body = {"messages": MESSAGES, "max_tokens": 400, "n": 3, "stream": True}
            async with server.client.request(CHAT, method="POST", headers=JSON) as conn:
                await conn.send(json.dumps(body).encode())
                await conn.send_complete()
                seen = b""
                while seen.count(b"data: ") < 12:
                    seen += await conn.receive()
                await conn.disconnect()
                conn._client_send.close()  # (the test client hangs on a disconnect otherwise)
            await wait_until(lambda: server.handles.scheduler.active_rows == 0)
            await wait_until(server.worker.settled)
            counters = server.handles.scheduler.counters
            assert counters.aborted_rows == 3 and counters.forked_rows == 2
            status, after = await post(server, CHAT, {"messages": MESSAGES, "max_tokens": 3, "n": 2})
            assert status == 200 and len(after["choices"]) == 2
