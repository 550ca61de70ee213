"""The HTTP surface over the real actors and a FakeWorker, through quart-trio's test client."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import attrs
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from tests.fakes import FakeTokenizer, FakeWorker, token_text

CHAT = "/v1/chat/completions"


@asynccontextmanager
async def server(worker: FakeWorker | None = None, **config):
    worker = worker or FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client(), handles, worker
        nursery.cancel_scope.cancel()


def frames(body: bytes) -> list[str]:
    assert body.endswith(b"\n\n")
    return [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f]


def expected_text(worker: FakeWorker, prompt_ids, n: int) -> str:
    return "".join(token_text(t) for t in worker.expected(tuple(prompt_ids), n))


def chat_prompt(content: str) -> list[int]:
    return FakeTokenizer().encode_chat([{"role": "user", "content": content}])


async def error_of(response) -> dict:
    assert response.content_type == "application/json"
    body = await response.get_json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_health_is_byte_exact(autojump_clock):
    async with server() as (client, _, _):
        response = await client.get("/health")
        assert response.status_code == 200
        assert await response.get_data() == b'{"status": "ok"}'
        assert response.content_type == "application/json"


async def test_models_and_stats(autojump_clock):
    async with server(batch=4) as (client, handles, _):
        models = await (await client.get("/v1/models")).get_json()
        assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
        missing = await client.get("/v1/models/nope")
        assert missing.status_code == 404 and (await missing.get_json())["error"]["code"] == "model_not_found"
        stats = await (await client.get("/stats")).get_json()
        assert stats["batch"]["configured"] == 4 and stats["batch"]["mode"] == "batch"
        assert stats["batch"]["active_rows"] == 0 and stats["batch"]["pending_rows"] == 0
        assert stats["admission"]["max_safe_context"] == 4096


async def test_unknown_route_is_json_404_and_wrong_method_json_405(autojump_clock):
    async with server() as (client, _, _):
        response = await client.get("/nope")
        assert response.status_code == 404
        assert (await error_of(response))["message"] == "not found"
        response = await client.get(CHAT)  # a wrong method is a 405, not a 404
        assert response.status_code == 405 and "POST" in response.headers["Allow"]
        assert (await error_of(response))["code"] == "method_not_allowed"


async def test_bad_input_is_400_in_the_openai_shape(autojump_clock):
    async with server() as (client, _, _):
        bad = [
            (
                await client.post(CHAT, data=b"{not json", headers={"Content-Type": "application/json"}),
                "invalid JSON body",
            ),
            (await client.post(CHAT, data=b"[1, 2]"), "invalid JSON body"),
            (await client.post(CHAT, json={"messages": []}), "messages required"),
            (
                await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "seed": "7"}), "seed"),
            (await client.post(CHAT, json={"messages": [{"role": "user", "content": "RAISE"}]}), "prompt build failed"),
            (await client.post("/v1/completions", json={"prompt": ""}), "prompt (a non-empty string)"),
        ]
        for response, message in bad:
            assert response.status_code == 400, message
            error = await error_of(response)
            assert message in error["message"] and error["type"] == "invalid_request_error"


async def test_chat_non_stream(autojump_clock):
    async with server() as (client, _, worker):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        result = await (await client.post(CHAT, json=body)).get_json()
    choice = result["choices"][0]
    assert result["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": expected_text(worker, chat_prompt("hi"), 5)}
    assert choice["finish_reason"] == "length"
    assert result["usage"] == {
        "prompt_tokens": len(chat_prompt("hi")),
        "completion_tokens": 5,
        "total_tokens": len(chat_prompt("hi")) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
        "lane": "batched",
    }


async def test_chat_stream_shape(autojump_clock):
    async with server() as (client, _, worker):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        body["stream_options"] = {"include_usage": True}
        response = await client.post(CHAT, json=body)
        assert response.content_type == "text/event-stream"
        data = frames(await response.get_data())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(f) for f in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == expected_text(worker, chat_prompt("hi"), 4)
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    final = chunks[-1]  # include_usage: a last chunk with no choices carries the usage
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 4 and final["usage"]["lane"] == "batched"
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_stop_string_ends_with_stop(autojump_clock):
    async with server() as (client, _, worker):
        tokens = worker.expected(tuple(chat_prompt("hi")), 10)
        stop = token_text(tokens[2]).strip()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stop": [stop, ""]}
        result = await (await client.post(CHAT, json=body)).get_json()
        await trio.sleep(1)
        assert worker.rows == {}  # the row left the batch
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["choices"][0]["message"]["content"] == "".join(token_text(t) for t in tokens[:2])


async def test_a_seeded_request_is_batched_like_any_other(autojump_clock):
    async with server() as (client, _, _):
        for seed in ({"seed": 7}, {"seed": None}, {}):
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **seed}
            result = await (await client.post(CHAT, json=body)).get_json()
            assert result["usage"]["lane"] == "batched"


async def test_completions_stream_and_whole(autojump_clock):
    async with server() as (client, _, worker):
        prompt_ids = FakeTokenizer().encode("once")
        whole = await (await client.post("/v1/completions", json={"prompt": "once", "max_tokens": 3})).get_json()
        streamed = frames(
            await (
                await client.post("/v1/completions", json={"prompt": "once", "max_tokens": 3, "stream": True})
            ).get_data()
        )
    assert whole["object"] == "text_completion"
    assert whole["choices"][0]["text"] == expected_text(worker, prompt_ids, 3)
    assert streamed[-1] == "[DONE]"
    chunks = [json.loads(f) for f in streamed[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage anywhere in the stream


async def test_prompt_over_the_memory_budget_is_400_and_max_tokens_is_clamped(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    room = 20  # tokens of KV the budget leaves
    budget_gb = (
        worker.info.weights_bytes + worker.info.prefill_transient_bytes + room * worker.info.kv_bytes_per_token
    ) / 1e9
    async with server(worker, memory_budget_gb=budget_gb) as (client, handles, _):
        assert handles.ceiling.max_safe_context == room
        long = await client.post("/v1/completions", json={"prompt": "x" * 25})
        assert long.status_code == 400
        error = await error_of(long)
        assert error["type"] == "memory_admission" and error["code"] == "context_over_budget"
        assert error["message"].startswith("prompt is 25 tokens but the memory budget caps safe context at 20")
        ok = await (await client.post("/v1/completions", json={"prompt": "x" * 15, "max_tokens": 100})).get_json()
        assert ok["usage"]["completion_tokens"] == 5 and ok["choices"][0]["finish_reason"] == "length"


async def test_n_choices_share_the_memory_budget_but_each_has_the_whole_window(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    worker.info = attrs.evolve(worker.info, context_length=64)
    body = {"prompt": "x" * 40, "max_tokens": 100, "n": 2}  # 40 prompt tokens, 24 left in the window
    async with server(worker) as (client, handles, _):  # memory for far more than 2 rows of 64
        assert handles.ceiling.max_safe_context == 64
        ok = await (await client.post("/v1/completions", json=body)).get_json()
        assert [c["finish_reason"] for c in ok["choices"]] == ["length", "length"]
        assert ok["usage"]["completion_tokens"] == 2 * 24
    room = 70  # tokens of KV the budget leaves: one row of 40 + 24 fits, two do not
    budget_gb = (
        worker.info.weights_bytes + worker.info.prefill_transient_bytes + room * worker.info.kv_bytes_per_token
    ) / 1e9
    async with server(worker, memory_budget_gb=budget_gb, batch=4) as (client, _, _):
        over = await client.post("/v1/completions", json=body)
        assert over.status_code == 400
        error = await error_of(over)
        assert error["type"] == "memory_admission" and error["code"] == "context_over_budget"
        assert "35 for each of the request's 2 choices" in error["message"]
        alone = await (await client.post("/v1/completions", json={**body, "n": 1})).get_json()
        assert alone["usage"]["completion_tokens"] == 24  # the window, not the memory, clamps it


async def test_full_queue_is_503_with_retry_after(autojump_clock):
    worker = FakeWorker(step_cost=1.0)
    async with server(worker, batch=1, max_queue=1) as (client, handles, _):
        results = {}

        async def stream(name):
            body = {"prompt": "go", "max_tokens": 5, "stream": True}
            results[name] = await client.post("/v1/completions", json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, "running")
            await trio.sleep(0.5)
            nursery.start_soon(stream, "queued")
            await trio.sleep(0.5)
            assert handles.admission.waiting_rows == 1  # what --max-queue bounds
            refused = await client.post("/v1/completions", json={"prompt": "go"})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert (await error_of(refused))["code"] == "queue_full"
        for name in ("running", "queued"):
            assert frames(await results[name].get_data())[-1] == "[DONE]"


async def test_client_disconnect_aborts_only_that_row(autojump_clock):
    worker = FakeWorker(step_cost=1.0)
    async with server(worker) as (client, handles, _):
        others = {}

        async def bystander():
            body = {"prompt": "other", "max_tokens": 12}
            others["result"] = await (await client.post("/v1/completions", json=body)).get_json()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(bystander)
            async with client.request(
                "/v1/completions", method="POST", headers={"Content-Type": "application/json"}
            ) as conn:
                await conn.send(json.dumps({"prompt": "leaver", "max_tokens": 50, "stream": True}).encode())
                await conn.send_complete()
                for _ in range(3):
                    await conn.receive()
                await conn.disconnect()
                left_at = trio.current_time()
                conn._client_send.close()  # else the quart-trio test client waits forever after a disconnect
        leaver_prompt = tuple(FakeTokenizer().encode("leaver"))
        [leaver_id] = [rid for rid, spec in worker.specs.items() if spec.prompt == leaver_prompt]
        closed_at, _ = worker.closed[leaver_id]
        assert left_at <= closed_at <= left_at + worker.step_cost
        assert handles.admission.in_flight == 0
        assert handles.scheduler.counters.aborted_rows == 1
        assert others["result"]["choices"][0]["text"] == expected_text(worker, FakeTokenizer().encode("other"), 12)
        assert not worker.violations


async def test_mid_stream_failure_emits_an_error_frame(autojump_clock):
    worker = FakeWorker(fail_step_at=2)
    async with server(worker) as (client, _, _):
        body = {"prompt": "boom", "max_tokens": 10, "stream": True}
        data = frames(await (await client.post("/v1/completions", json=body)).get_data())
        # the error frame, then [DONE] and nothing else (vLLM's ending: a client reads to [DONE])
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        error = json.loads(data[-2])["error"]
        assert "generation failed" in error["message"] and error["type"] == "server_error"
        assert all("choices" in json.loads(frame) for frame in data[:-2])
        worker.fail_step_at = worker._steps + 2
        chat = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 10, "stream": True}
        data = frames(await (await client.post("/v1/chat/completions", json=chat)).get_data())
        assert data[-1] == "[DONE]" and "generation failed" in json.loads(data[-2])["error"]["message"]
        assert all("choices" in json.loads(frame) for frame in data[:-2])
        whole = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert whole.status_code == 200


async def test_a_burst_through_http_shares_one_group_prefill(autojump_clock):
    # The requests reach the queue one at a time (each is read and templated on the event loop);
    # the arrival hold keeps the first ones from being prefilled without the rest. With
    # --arrival-window-ms 0 the first forward here took 1, 2 or 3 of the 6 rows.
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with server(worker, batch=8, group_prefill="on") as (client, handles, _):
        statuses = []

        async def post(i):
            body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}
            statuses.append((await client.post(CHAT, json=body)).status_code)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(post, i)
        bad = await client.post(CHAT, json={"messages": "nope"})
        assert bad.status_code == 400
        assert statuses == [200] * 6
        assert handles.arrivals.pending == 0
        batch = (await (await client.get("/stats")).get_json())["batch"]
        assert batch["held_heads"] >= 1 and batch["grouped_rows"] >= 4
        assert [row for row, *_ in batch["recent_opens"]][:4] == [1, 2, 3, 4]
    # (A request counts from its route's first line; now and then the test client hands the last
    # one to its route only after the others have settled: 5 of 6 in about one run of ten.)
    name, rows = next((name, arg) for _, name, arg in worker.calls if name in ("prefill", "prefill_group"))
    assert name == "prefill_group" and rows[:4] == (1, 2, 3, 4)
