"""Chat streams carry logprobs: each chunk the entries of the tokens generated since the previous
chunk that carried any, so the chunks' `logprobs.content` concatenate to exactly the whole answer's
list — reasoning, tool-call markup, text a stop string held back and EOS included. Real actors and
a FakeWorker scripted token by token (with made-up logprobs) behind a thinking tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.engine.rows import TokenOut, TopLogprob
from tests.fakes import FakeTokenizer, FakeWorker, ScriptDetokenizer

CHAT = "/v1/chat/completions"
CALL = '{"name": "f", "arguments": {"a": 1}}'
# Token i + 1 is SCRIPT[i]; EOS follows the script.
SCRIPT = ["<think>", "Let me", " think.", "</think>", "Hello", " wor", "ld", "<tool_call>", CALL, "</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "hi"}]


def logprob_of(token: int) -> float:
    return -0.25 * token


class LogprobWorker(FakeWorker):
    """Reports each token's logprob and, when asked, `top_logprobs` alternatives (the sampled
    token first, as a greedy row's are)."""

    def _next_token(self, row: Any) -> TokenOut:
        out = super()._next_token(row)
        sampling = row.spec.sampling
        if not (sampling.logprobs or sampling.top_logprobs):
            return out
        top = tuple(TopLogprob(out.token + 100 * k, logprob_of(out.token) - k) for k in range(sampling.top_logprobs))
        return TokenOut(out.row_id, out.token, out.finish, logprob=logprob_of(out.token), top_logprobs=top)


class ThinkingTokenizer(FakeTokenizer):
    has_thinking = True

    def detokenizer(self) -> ScriptDetokenizer:
        return ScriptDetokenizer(SCRIPT)

    def id_to_token(self, token_id: int) -> str:
        return f"<{token_id}>"


@asynccontextmanager
async def server(token_fn: Callable[[tuple[int, ...], int], int] | None = None, **config: Any):
    """Greedy rows reading SCRIPT then EOS, or `token_fn`'s tokens (no EOS)."""
    worker = LogprobWorker(
        prefill_cost=0.1,
        join_cost=0.1,
        step_cost=1.0,
        token_fn=token_fn or (lambda prompt, position: position + 1),
        eos_at=lambda spec: None if token_fn else len(SCRIPT),
    )
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: ThinkingTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


async def chunks_of(client, body: dict[str, Any], *, read_after: float = 0.0) -> list[dict[str, Any]]:
    """A stream's chunks, read as they come (the test client holds only a few unread writes), or
    from `read_after` seconds on (the stream falls behind)."""
    async with client.request(CHAT, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        await trio.sleep(read_after)
        raw = b""
        while True:
            try:
                raw += await conn.receive()
            except trio.EndOfChannel:
                break
    frames = [f.removeprefix("data: ") for f in raw.decode().split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def streamed_logprobs(chunks: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index and choice["logprobs"] is not None:
                out += choice["logprobs"]["content"]
    return out


SAMPLED = [{"id": t, "logprob": logprob_of(t)} for t in [*range(1, len(SCRIPT) + 1), 0]]


@pytest.mark.parametrize(
    "fields",
    [
        {},  # no tools: the call markup is content
        {"tools": TOOLS},  # reasoning, prose, then a call
        {"tools": TOOLS, "top_logprobs": 2},
        {"stop": ["world"]},  # " wor" is held back as a partial stop string, "ld" matches it
        {"stop": ["me th"]},  # a stop inside the reasoning
        {"max_tokens": 6},
        {"n": 2, "tools": TOOLS},
    ],
)
async def test_chunks_concatenate_to_the_whole_answers_logprobs(autojump_clock, fields):
    body = {"messages": USER, "max_tokens": 50, "logprobs": True, **fields}
    async with server(batch=4) as client:
        whole = await (await client.post(CHAT, json=body)).get_json()
        chunks = await chunks_of(client, body)
    for choice in whole["choices"]:
        expected = choice["logprobs"]["content"]
        assert len(expected) == whole["usage"]["completion_tokens"] // len(whole["choices"])
        assert streamed_logprobs(chunks, choice["index"]) == expected
    if "top_logprobs" not in fields and "stop" not in fields:
        assert whole["choices"][0]["logprobs"]["content"] == SAMPLED[: body["max_tokens"]]
    # every choice of every chunk has the key (null when it carries no token), as OpenAI's do
    assert all("logprobs" in c for chunk in chunks for c in chunk["choices"])


async def test_each_chunk_carries_the_tokens_of_its_text(autojump_clock):
    body = {"messages": USER, "max_tokens": 50, "logprobs": True, "tools": TOOLS}
    async with server() as client:
        chunks = await chunks_of(client, body)
    carried = []
    for chunk in chunks:
        [choice] = chunk["choices"]
        ids = [entry["id"] for entry in (choice["logprobs"] or {"content": []})["content"]]
        carried.append((choice["delta"], ids, choice["finish_reason"]))
    header = carried[6][0]["tool_calls"][0]
    assert header["function"] == {"name": "f", "arguments": ""}
    assert carried == [
        ({"role": "assistant", "content": ""}, [], None),
        ({"reasoning": "Let me"}, [1, 2], None),  # "<think>" shows nothing: it rides with the next
        ({"reasoning": " think."}, [3], None),
        ({"content": "Hello"}, [4, 5], None),
        ({"content": " wor"}, [6], None),
        ({"content": "ld"}, [7], None),
        ({"tool_calls": [header]}, [8, 9], None),  # the header waits for the name
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}, [], None),
        ({}, [10, 0], "tool_calls"),  # the closing markup and EOS
    ]


async def test_top_logprobs_entries_stream_in_the_whole_answers_shape(autojump_clock):
    body = {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    async with server() as client:
        chunks = await chunks_of(client, body)
    top = [{"id": 1, "token": "<1>", "logprob": -0.25}, {"id": 101, "token": "<101>", "logprob": -1.25}]
    assert streamed_logprobs(chunks)[0] == {**top[0], "top_logprobs": top}


async def test_a_stream_without_logprobs_has_no_logprobs_key(autojump_clock):
    async with server() as client:
        chunks = await chunks_of(client, {"messages": USER, "max_tokens": 3})
    assert chunks and all("logprobs" not in c for chunk in chunks for c in chunk["choices"])


async def test_a_stream_that_fell_behind_sends_each_turns_tokens_with_their_text(autojump_clock):
    prose = [5, 6, 7]  # "Hello", " wor", "ld"
    body = {"messages": USER, "max_tokens": 60, "logprobs": True}
    async with server(token_fn=lambda prompt, position: prose[position % 3]) as client:
        whole = await (await client.post(CHAT, json=body)).get_json()
        chunks = await chunks_of(client, body, read_after=100.0)
    carried = [(c["delta"].get("content"), c["logprobs"]) for chunk in chunks for c in chunk["choices"]]
    texts = [(text, [e["id"] for e in logprobs["content"]]) for text, logprobs in carried[1:-1]]
    assert len(texts) < 30  # turns of several tokens: one chunk each
    assert all(text == "".join(SCRIPT[i - 1] for i in ids) for text, ids in texts)
    assert streamed_logprobs(chunks) == whole["choices"][0]["logprobs"]["content"]
