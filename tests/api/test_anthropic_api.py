"""/v1/messages and /v1/messages/count_tokens over the real actors and a FakeWorker (MockClock).

Event shapes are checked against the anthropic SDK's own pydantic models, so a field the SDK
requires cannot go missing unnoticed.
"""

from __future__ import annotations

import json

import pydantic
import pytest
import trio

from api.anthropic import routes as anthropic_routes
from tests.fakes import FakeTokenizer, FakeWorker, token_text
from tests.helpers.fake_server import server
from tests.helpers.http import post_stream

anthropic = pytest.importorskip("anthropic")

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
MESSAGE = pydantic.TypeAdapter(anthropic.types.Message)


def chat_prompt(*messages: tuple[str, str]) -> list[int]:
    return FakeTokenizer().encode_chat([{"role": r, "content": c} for r, c in messages])


def expected_text(worker: FakeWorker, prompt, n: int) -> str:
    return "".join(token_text(t) for t in worker.expected(tuple(prompt), n))


def sse_events(body: bytes) -> list[tuple[str, dict]]:
    """(event name, payload) per SSE frame, each payload validated by the SDK's event model."""
    out = []
    for frame in body.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"]
        if lines["event"] not in ("ping", "error"):
            EVENT.validate_python(payload)
        out.append((lines["event"], payload))
    return out


def body(content: str = "hi", **extra) -> dict:
    return {"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": content}], **extra}


async def test_non_stream_message(autojump_clock):
    async with server() as (client, _, worker):
        response = await client.post(
            MESSAGES, json=body(system="be brief"), headers={"anthropic-version": "2023-06-01"}
        )
        assert response.status_code == 200
        message = await response.get_json()
    MESSAGE.validate_python(message)
    prompt = chat_prompt(("system", "be brief"), ("user", "hi"))
    assert message["id"].startswith("msg_") and len(message["id"]) == 4 + 24
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == "fake-model"
    assert message["content"] == [{"type": "text", "text": expected_text(worker, prompt, 5)}]
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": len(prompt), "output_tokens": 5}


async def test_stream_event_order(autojump_clock):
    async with server() as (client, _, worker):
        response = await client.post(MESSAGES, json=body(stream=True, max_tokens=4))
        assert response.status_code == 200 and response.content_type == "text/event-stream"
        events = sse_events(await response.get_data())
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": len(chat_prompt(("user", "hi"))), "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta")
    assert text == expected_text(worker, chat_prompt(("user", "hi")), 4)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


async def test_ping_events_keep_a_long_prefill_alive(autojump_clock):
    worker = FakeWorker(chunk=4, prefill_cost=3.0, join_cost=0.1, step_cost=0.1)
    async with server(worker) as (client, _, _):
        long = "x" * 40  # ~13 prefill chunks of 3 s: ~39 s before the first token
        names = [
            name for name, _ in sse_events(await post_stream(client, MESSAGES, body(long, stream=True, max_tokens=2)))
        ]
    first_block = names.index("content_block_start")
    pings = names[:first_block].count("ping")
    assert pings >= 1 + int(36 / anthropic_routes.PING_INTERVAL_S)  # one at start, then one per quiet interval
    assert "ping" not in names[first_block:]  # tokens every 0.1 s: no keepalive needed
    assert names[-1] == "message_stop"


async def test_stop_sequence_is_reported(autojump_clock):
    async with server() as (client, _, worker):
        tokens = worker.expected(tuple(chat_prompt(("user", "hi"))), 10)
        stop = token_text(tokens[2]).strip()
        message = await (await client.post(MESSAGES, json=body(max_tokens=10, stop_sequences=[stop]))).get_json()
        streamed = sse_events(
            await post_stream(client, MESSAGES, body(max_tokens=10, stop_sequences=[stop], stream=True))
        )
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == stop
    assert message["content"][0]["text"] == "".join(token_text(t) for t in tokens[:2])
    assert streamed[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


async def test_eos_is_end_turn(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, eos_at=lambda spec: 3)
    async with server(worker) as (client, _, _):
        message = await (await client.post(MESSAGES, json=body(max_tokens=10))).get_json()
    assert message["stop_reason"] == "end_turn" and message["usage"]["output_tokens"] == 4


async def test_count_tokens_is_the_prompt_length_and_never_reaches_the_worker(autojump_clock):
    async with server() as (client, _, worker):
        request = {
            "model": "fake-model",
            "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "count me"}]}],
        }
        response = await client.post(COUNT, json=request)
        assert response.status_code == 200
        counted = (await response.get_json())["input_tokens"]
        assert worker.calls == [] and worker.specs == {}
        message = await (await client.post(MESSAGES, json={**request, "max_tokens": 2})).get_json()
    assert counted == len(chat_prompt(("system", "sys"), ("user", "count me")))
    assert counted == message["usage"]["input_tokens"]


async def error_of(response) -> dict:
    assert response.content_type == "application/json"
    payload = await response.get_json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    return payload["error"]


TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
TYPE_ERR = ("invalid_request_error", "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'")
OBJECT_ERR = ("invalid_request_error", "tool_choice: must be an object")
THINKING_ERR = ("invalid_request_error", "thinking.type: must be 'enabled', 'adaptive' or 'disabled'")


async def test_errors_use_the_anthropic_envelope(autojump_clock):
    async with server() as (client, _, _):
        cases = [
            (
                await client.post(MESSAGES, data=b"{nope", headers={"Content-Type": "application/json"}),
                400,
                "invalid_request_error",
                "invalid JSON body",
            ),
            (
                await client.post(MESSAGES, json={"messages": []}),
                400,
                "invalid_request_error",
                "messages: at least one message is required",
            ),
            (await client.post(MESSAGES, json=body(temperature="hot")), 400, "invalid_request_error", "temperature"),
            (await client.post(MESSAGES, json=body(max_tokens=0)), 400, "invalid_request_error", "max_tokens"),
            (
                await client.post(
                    MESSAGES,
                    json={
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "audio", "source": {"type": "base64", "data": "AAAA"}}],
                            }
                        ]
                    },
                ),
                400,
                "invalid_request_error",
                "audio",
            ),
            (
                await client.post(
                    MESSAGES,
                    json={
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {
                                        "type": "image",
                                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                                    }
                                ],
                            }
                        ]
                    },
                ),
                400,
                "invalid_request_error",
                "not supported",
            ),
            (await client.post(MESSAGES, json=body("RAISE")), 400, "invalid_request_error", "prompt build failed"),
            (await client.post(COUNT, json={"messages": "nope"}), 400, "invalid_request_error", "messages"),
            # loose fields the Messages API refuses
            (
                await client.post(MESSAGES, json={**body(), "messages": [{"role": "tool", "content": "s"}]}),
                400,
                "invalid_request_error",
                "messages.0.role: must be 'user', 'assistant' or 'system'",
            ),
            (await client.post(MESSAGES, json=body(tools=TOOLS, tool_choice={"type": "bogus"})), 400, *TYPE_ERR),
            (await client.post(MESSAGES, json=body(tools=TOOLS, tool_choice="any")), 400, *OBJECT_ERR),
            (await client.post(MESSAGES, json=body(thinking={"type": 7})), 400, *THINKING_ERR),
            (await client.post("/v1/messages/nope", json={}), 404, "not_found_error", "not found"),
        ]
        for response, status, kind, message in cases:
            assert response.status_code == status, message
            error = await error_of(response)
            assert error["type"] == kind and message in error["message"], error
        # other surfaces keep the OpenAI shape
        openai_404 = await (await client.get("/v1/nope")).get_json()
        assert set(openai_404["error"]) == {"message", "type", "param", "code"}


async def test_admission_errors_keep_their_status(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    room = 20
    budget_gb = (
        worker.info.weights_bytes + worker.info.prefill_transient_bytes + room * worker.info.kv_bytes_per_token
    ) / 1e9
    async with server(worker, memory_budget_gb=budget_gb) as (client, _, _):
        response = await client.post(MESSAGES, json=body("y" * 40))
        assert response.status_code == 400
        assert "memory budget" in (await error_of(response))["message"]

    worker = FakeWorker(step_cost=1.0)
    async with server(worker, batch=1, max_queue=1) as (client, handles, _):

        async def occupy():
            assert (await client.post(MESSAGES, json=body(max_tokens=5))).status_code == 200

        async with trio.open_nursery() as nursery:
            nursery.start_soon(occupy)
            await trio.sleep(0.5)
            nursery.start_soon(occupy)
            await trio.sleep(0.5)
            refused = await client.post(MESSAGES, json=body())
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert (await error_of(refused))["type"] == "overloaded_error"


async def test_mid_stream_failure_ends_with_the_error_event(autojump_clock):
    worker = FakeWorker(fail_step_at=3, prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with server(worker) as (client, handles, _):
        events = sse_events(await post_stream(client, MESSAGES, body(stream=True, max_tokens=10)))
        names = [name for name, _ in events]
        assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
        # as Anthropic's own streams: nothing follows the error (no message_stop to read as a normal end)
        assert names[-1] == "error" and names.count("error") == 1
        assert not {"content_block_stop", "message_delta", "message_stop"} & set(names)
        assert events[-1][1]["error"]["type"] == "api_error"
        assert "generation failed" in events[-1][1]["error"]["message"]
        # non-stream: a 500 in the Anthropic envelope; the server keeps serving
        worker.fail_step_at = worker._steps + 2
        failed = await client.post(MESSAGES, json=body(max_tokens=10))
        assert failed.status_code == 500 and (await error_of(failed))["type"] == "api_error"
        ok = await client.post(MESSAGES, json=body(max_tokens=2))
        assert ok.status_code == 200
        assert handles.admission.in_flight == 0


async def test_client_disconnect_mid_stream_aborts_the_row(autojump_clock):
    worker = FakeWorker(chunk=4, prefill_cost=3.0, join_cost=0.1, step_cost=1.0)
    async with server(worker) as (client, handles, _):
        async with client.request(MESSAGES, method="POST", headers={"Content-Type": "application/json"}) as conn:
            await conn.send(json.dumps(body("z" * 40, stream=True, max_tokens=50)).encode())
            await conn.send_complete()
            for _ in range(3):  # message_start+ping, then pings while the prefill runs
                await conn.receive()
            await conn.disconnect()
            left_at = trio.current_time()
            conn._client_send.close()  # else the quart-trio test client waits forever after a disconnect
        await trio.sleep(10)
        [row_id] = worker.specs
        closed_at, reusable = worker.closed[row_id]
        assert left_at <= closed_at <= left_at + worker.prefill_cost and not reusable
        assert handles.admission.in_flight == 0 and handles.scheduler.counters.aborted_rows == 1
        assert not worker.violations
