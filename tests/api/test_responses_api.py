"""/v1/responses (and GET / DELETE /v1/responses/{id}) over the real actors and a FakeWorker
(MockClock). Objects and events are validated against the openai SDK's pydantic models."""

from __future__ import annotations

import json

import pydantic
import pytest
import trio

from tests.fakes import FakeTokenizer, FakeWorker, token_text
from tests.helpers.fake_server import server
from tests.helpers.http import post_stream

openai = pytest.importorskip("openai")
from openai.types.responses import Response as SdkResponse  # noqa: E402
from openai.types.responses import ResponseItem, ResponseStreamEvent  # noqa: E402

RESPONSES = "/v1/responses"
ITEM = pydantic.TypeAdapter(ResponseItem)


def INPUT_TEXT(text: str) -> dict:
    return {"type": "input_text", "text": text}


EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
RESPONSE = pydantic.TypeAdapter(SdkResponse)


def prompt_of(*messages: tuple[str, str]) -> list[int]:
    return FakeTokenizer().encode_chat([{"role": r, "content": c} for r, c in messages])


def expected_text(worker: FakeWorker, prompt, n: int) -> str:
    return "".join(token_text(t) for t in worker.expected(tuple(prompt), n))


def sse_events(body: bytes) -> list[dict]:
    out = []
    for frame in body.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"]
        EVENT.validate_python(payload)
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


async def create(client, **body) -> dict:
    response = await client.post(RESPONSES, json={"model": "fake-model", "max_output_tokens": 4, **body})
    assert response.status_code == 200, await response.get_data()
    result = await response.get_json()
    RESPONSE.validate_python(result)
    return result


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


async def test_non_stream_response(autojump_clock):
    async with server() as (client, _, worker):
        result = await create(client, input="hi", instructions="be brief")
    prompt = prompt_of(("system", "be brief"), ("user", "hi"))
    assert result["id"].startswith("resp_") and result["object"] == "response"
    assert result["status"] == "incomplete" and result["incomplete_details"] == {"reason": "max_output_tokens"}
    assert result["instructions"] == "be brief" and result["previous_response_id"] is None
    [message] = result["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    assert text_of(result) == expected_text(worker, prompt, 4)
    assert result["usage"] == {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt) + 4,
    }


async def test_eos_is_completed(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, eos_at=lambda spec: 2)
    async with server(worker) as (client, _, _):
        result = await create(client, input="hi", max_output_tokens=10)
    assert result["status"] == "completed" and result["incomplete_details"] is None


async def test_stream_events_in_order(autojump_clock):
    async with server() as (client, _, worker):
        events = sse_events(
            await post_stream(client, RESPONSES, {"input": "hi", "stream": True, "max_output_tokens": 3})
        )
        types = [e["type"] for e in events]
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert set(types[4:-4]) == {"response.output_text.delta"}
        assert types[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",  # cut by max_output_tokens
        ]
        assert events[-2]["item"]["status"] == "incomplete"
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == expected_text(worker, prompt_of(("user", "hi")), 3)
        assert events[-4]["text"] == deltas
        final = events[-1]["response"]
        assert final["status"] == "incomplete" and text_of(final) == deltas
        assert final["id"] == events[0]["response"]["id"]
        # the final object is what the store keeps
        stored = await (await client.get(f"{RESPONSES}/{final['id']}")).get_json()
        assert stored == final
        items = await (await client.get(f"{RESPONSES}/{final['id']}/input_items")).get_json()
        assert items["object"] == "list" and [i["content"] for i in items["data"]] == [[INPUT_TEXT("hi")]]


async def test_previous_response_id_continues_the_conversation(autojump_clock):
    async with server() as (client, _, worker):
        first = await create(client, input="hi", instructions="sys")
        second = await create(client, input="more", previous_response_id=first["id"])
        third = await create(client, input="again", previous_response_id=second["id"], instructions="new sys")
    said1, said2 = text_of(first), text_of(second)
    prompts = [spec.prompt for spec in worker.specs.values()]
    assert prompts[1] == tuple(prompt_of(("system", "sys"), ("user", "hi"), ("assistant", said1), ("user", "more")))
    # instructions carry forward unless replaced
    assert prompts[2] == tuple(
        prompt_of(
            ("system", "new sys"),
            ("user", "hi"),
            ("assistant", said1),
            ("user", "more"),
            ("assistant", said2),
            ("user", "again"),
        )
    )
    assert second["previous_response_id"] == first["id"] and second["instructions"] == "sys"
    assert third["instructions"] == "new sys"


async def test_input_items_list_openais_item_shapes_newest_first_in_pages(autojump_clock):
    async with server() as (client, _, _):
        first = await create(
            client,
            input=[
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "Hello"},
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            ],
        )
        second = await create(client, input="more", previous_response_id=first["id"])

        async def listing(response_id: str, query: str = "") -> dict:
            answer = await client.get(f"{RESPONSES}/{response_id}/input_items{query}")
            assert answer.status_code == 200, await answer.get_data()
            page = await answer.get_json()
            for item in page["data"]:
                ITEM.validate_python(item)
            return page

        page = await listing(first["id"], "?order=asc")
        data = page["data"]
        assert [item["type"] for item in data] == ["message", "message", "function_call", "function_call_output"]
        assert data[1] == {
            "id": data[1]["id"],
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [INPUT_TEXT("Hello")],
        }
        assert data[1]["id"].startswith("msg_") and data[2]["id"].startswith("fc_")
        assert data[3]["call_id"] == "call_1" and data[3]["output"] == "42"
        assert (page["first_id"], page["last_id"], page["has_more"]) == (data[0]["id"], data[3]["id"], False)
        assert (await listing(first["id"]))["data"] == data[::-1]  # OpenAI's default order: newest first
        # a continuation lists its whole input: the stored turns (same ids), the answer as output, the new turn
        later = (await listing(second["id"], "?order=asc"))["data"]
        assert later[:4] == data and later[4]["id"] == first["output"][0]["id"]
        assert later[4]["content"][0]["type"] == "output_text" and later[5]["content"] == [INPUT_TEXT("more")]
        # pages: limit and after
        one = await listing(second["id"], "?limit=2")
        assert [item["id"] for item in one["data"]] == [later[5]["id"], later[4]["id"]] and one["has_more"]
        rest = await listing(second["id"], f"?limit=100&after={one['last_id']}")
        assert rest["data"] == later[3::-1] and not rest["has_more"]
        for query, param in (
            ("?order=up", "order"),
            ("?limit=0", "limit"),
            ("?limit=x", "limit"),
            ("?limit=%C2%B2", "limit"),  # a unicode digit
            ("?limit=" + "9" * 5000, "limit"),  # past int()'s 4300 digits: was a 500
            ("?limit=101", "limit"),
            ("?after=no", "after"),
        ):
            bad = await client.get(f"{RESPONSES}/{first['id']}/input_items{query}")
            assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == param


async def test_unknown_ids_are_404_in_the_responses_shape(autojump_clock):
    async with server() as (client, _, worker):
        for response in (
            await client.post(RESPONSES, json={"input": "x", "previous_response_id": "resp_nope"}),
            await client.get(f"{RESPONSES}/resp_nope"),
            await client.delete(f"{RESPONSES}/resp_nope"),
        ):
            assert response.status_code == 404
            error = (await response.get_json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and "resp_nope" in error["message"]
        assert worker.specs == {}


async def test_store_false_is_not_kept_and_delete_removes(autojump_clock):
    async with server() as (client, _, _):
        unstored = await create(client, input="hi", store=False)
        assert unstored["store"] is False
        assert (await client.get(f"{RESPONSES}/{unstored['id']}")).status_code == 404
        follow = await client.post(RESPONSES, json={"input": "x", "previous_response_id": unstored["id"]})
        assert follow.status_code == 404
        kept = await create(client, input="hi")
        assert (await client.get(f"{RESPONSES}/{kept['id']}")).status_code == 200
        deleted = await client.delete(f"{RESPONSES}/{kept['id']}")
        assert await deleted.get_json() == {"id": kept["id"], "object": "response", "deleted": True}
        assert (await client.get(f"{RESPONSES}/{kept['id']}")).status_code == 404


async def test_bad_input_is_400_in_the_responses_shape(autojump_clock):
    async with server() as (client, _, _):
        cases = [
            (
                await client.post(RESPONSES, data=b"{nope", headers={"Content-Type": "application/json"}),
                "invalid JSON body",
            ),
            (await client.post(RESPONSES, json={}), "input"),
            (await client.post(RESPONSES, json={"input": [{"type": "mystery"}]}), "mystery"),
            (await client.post(RESPONSES, json={"input": "x", "temperature": -1}), "temperature"),
            (await client.post(RESPONSES, json={"input": "RAISE"}), "prompt build failed"),
            (await client.post(RESPONSES, json={"input": "x", "max_output_tokens": -1}), "max_output_tokens must be"),
            (await client.post(RESPONSES, json={"input": "x", "text": {"format": {"type": "xml"}}}), "text.format"),
            (await client.post(RESPONSES, json={"input": "x", "metadata": {"k": 1}}), "metadata must be"),
            (
                await client.post(RESPONSES, json={"input": "x", "tool_choice": {"type": "function", "name": "f"}}),
                "not in tools",
            ),
        ]
        for response, message in cases:
            assert response.status_code == 400, message
            error = (await response.get_json())["error"]
            assert error["type"] == "invalid_request_error" and message in error["message"], error


async def test_mid_stream_failure_ends_with_error_then_failed(autojump_clock):
    worker = FakeWorker(fail_step_at=3, prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with server(worker) as (client, handles, _):
        events = sse_events(
            await post_stream(client, RESPONSES, {"input": "hi", "stream": True, "max_output_tokens": 10})
        )
        types = [e["type"] for e in events]
        error_at = types.index("error")
        assert types[error_at:] == [
            "error",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.failed",
        ]
        assert events[error_at]["code"] == "server_error" and "generation failed" in events[error_at]["message"]
        final = events[-1]["response"]
        assert final["status"] == "failed" and final["error"]["code"] == "server_error"
        assert text_of(final)  # the text streamed before the failure is kept in the final object
        assert (await client.get(f"{RESPONSES}/{final['id']}")).status_code == 404  # failed: not stored
        worker.fail_step_at = worker._steps + 2
        failed = await client.post(RESPONSES, json={"input": "hi", "max_output_tokens": 10})
        assert failed.status_code == 500
        assert (await failed.get_json())["error"]["type"] == "server_error"
        assert (await client.post(RESPONSES, json={"input": "ok", "max_output_tokens": 2})).status_code == 200
        assert handles.admission.in_flight == 0


async def test_store_is_per_server(autojump_clock):
    async with server() as (client, _, _):
        kept = await create(client, input="hi")
    async with server() as (client, _, _):
        assert (await client.get(f"{RESPONSES}/{kept['id']}")).status_code == 404
        await trio.sleep(0)


async def test_the_store_shows_its_measured_memory_in_stats_and_metrics(autojump_clock):
    async with server() as (client, _, _):
        empty = (await (await client.get("/stats")).get_json())["responses_store"]
        assert (empty["entries"], empty["bytes"], empty["max_bytes"]) == (0, 0, 32 * 2**20)
        await create(client, input="hello")
        await create(client, input="hello", store=False)  # not kept
        block = (await (await client.get("/stats")).get_json())["responses_store"]
        assert block["entries"] == 1 and block["bytes"] > 1000  # a response object is KiBs of dicts
        metrics = (await (await client.get("/metrics")).get_data()).decode()
        assert f"mlx_trio:responses_store_bytes {float(block['bytes'])}" in metrics
        assert "mlx_trio:responses_store_entries 1.0" in metrics
        assert "mlx_trio:responses_store_evicted_total 0.0" in metrics
