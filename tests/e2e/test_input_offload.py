"""The API's input path never stalls the event loop, on the real engine (tiny model, real server).

A 10 MB chat body, a 6 MB count_tokens body and a prompt just under the size bound (tokenized on
a worker thread) arrive while a stream runs: the stream's largest gap between tokens stays under
a second and /health answers throughout; the oversized bodies are 400s in their protocol's shape.
A constraint the grammar engine cannot run is a 400 when the request arrives.

Real threads: the real clock, a generous `trio.fail_after`, and the one timed assertion the
server owes (a stalled loop showed 10-14 s gaps here).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from api import prompt_bounds
from model.text import grammar
from tests.realserver import CHAT, COMPLETIONS, RealServer, Streamed, real_server, stream

LIMIT_S = 120
MAX_GAP_S = 1.0
STREAM_TOKENS = 3000  # long enough to outlast every hostile body below on a slow core


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def chat_body(chars: int, **extra: Any) -> bytes:
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}).encode()


async def post(server: RealServer, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
    response = await server.client.post(path, data=data, headers={"Content-Type": "application/json"})
    return response.status_code, json.loads(await response.get_data())


@pytest.mark.slow
async def test_huge_bodies_never_stall_a_running_stream(model_dir):
    ticks: list[float] = []
    health: list[int] = []
    answers: dict[str, tuple[int, dict[str, Any]]] = {}
    hostile_done = trio.Event()

    def on_chunk(_: Streamed) -> None:
        ticks.append(trio.current_time())

    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, eos_token_ids=()) as server:
            context = server.handles.info.context_length
            # Just under the bound: templated and tokenized (on a worker thread), then refused on
            # its tokens as longer than the context.
            near_bound = context * prompt_bounds.CHARS_PER_TOKEN_FLOOR * prompt_bounds.NORMALIZER_SLACK - 1000

            async def hostile() -> None:
                while len(ticks) < 3:
                    await trio.sleep(0.01)
                answers["chat"] = await post(server, CHAT, chat_body(10 * 2**20))
                answers["count"] = await post(
                    server,
                    "/v1/messages/count_tokens",
                    json.dumps({"messages": [{"role": "user", "content": "x" * (6 * 2**20)}]}).encode(),
                )
                answers["near"] = await post(server, CHAT, chat_body(near_bound))
                hostile_done.set()

            async def probe_health() -> None:
                while not hostile_done.is_set():
                    health.append((await server.health())[0])
                    await trio.sleep(0.05)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hostile)
                nursery.start_soon(probe_health)
                body = {"prompt": "once upon a time", "max_tokens": STREAM_TOKENS, "temperature": 0}
                result = await stream(server, body, on_chunk=on_chunk)
                assert hostile_done.is_set(), "the stream ended before the hostile bodies were answered"

    assert result.finish_reason == "length" and result.chunks >= STREAM_TOKENS // 2
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < MAX_GAP_S, f"largest gap between tokens: {max(gaps):.2f} s"
    assert health and set(health) == {200}
    status, error = answers["chat"]
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    status, error = answers["count"]
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and "too long" in error["error"]["message"]
    status, error = answers["near"]
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error


async def test_a_prompt_within_the_bound_still_counts(model_dir):
    """The bound refuses only what cannot fit: a prompt at the context's size is counted."""
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            text = "a " * 1000
            status, body = await post(
                server,
                "/v1/messages/count_tokens",
                json.dumps({"messages": [{"role": "user", "content": text}]}).encode(),
            )
            assert status == 200 and body["input_tokens"] > 1000, body


needs_engine = pytest.mark.skipif(not grammar.available(), reason="llguidance is not installed")


@needs_engine
@pytest.mark.parametrize(
    "path,fields,param",
    [
        (CHAT, {"guided_regex": "(a|aa)*b{99999}"}, "guided_regex"),
        (CHAT, {"guided_grammar": "root ::= root"}, "guided_grammar"),
        (COMPLETIONS, {"guided_regex": "(a|aa)*b{99999}"}, "guided_regex"),
        (CHAT, {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
    ],
)
async def test_a_constraint_the_engine_cannot_run_is_a_400(model_dir, path, fields, param):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body: dict[str, Any] = {"max_tokens": 8, **fields}
            if path == CHAT:
                body["messages"] = [{"role": "user", "content": "hi"}]
            else:
                body["prompt"] = "hi"
            status, error = await post(server, path, json.dumps(body).encode())
            assert status == 400, error
            assert error["error"]["param"] == param and "grammar" in error["error"]["message"], error
            assert server.worker.specs == {}  # no row ever started
            # A grammar the engine can run still runs, constrained.
            body.pop(param)
            body["guided_regex"] = "(yes|no)"
            status, answer = await post(server, path, json.dumps(body).encode())
            assert status == 200, answer
            choice = answer["choices"][0]
            text = choice["message"]["content"] if path == CHAT else choice["text"]
            assert text in ("yes", "no"), answer
