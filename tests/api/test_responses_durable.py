"""The Responses routes over a durable store (`--response-store DIR`), real threads and a fast
FakeWorker: a stored response is on disk when its answer arrives, and a second server on the
same directory serves GET, input_items, previous_response_id and DELETE from it; `store: false`
writes nothing; /stats shows the durable block."""

from __future__ import annotations

from typing import Any

import trio

from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.fake_server import server

RESPONSES = "/v1/responses"
LIMIT_S = 30


def fast() -> FakeWorker:
    return FakeWorker(prefill_cost=0.001, join_cost=0.001, step_cost=0.001)


def holds(prompt: tuple[int, ...], text: str) -> bool:
    ids = FakeTokenizer().encode(text)
    return any(list(prompt[i : i + len(ids)]) == ids for i in range(len(prompt)))


async def create(client: Any, **body: Any) -> dict[str, Any]:
    response = await client.post(RESPONSES, json={"model": "fake-model", "max_output_tokens": 3, **body})
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


async def test_stored_responses_outlive_their_server(tmp_path):
    store = tmp_path / "responses"
    with trio.fail_after(LIMIT_S):
        async with server(fast(), response_store=str(store)) as (client, handles, _):
            first = await create(client, input="hi", instructions="be brief")
            assert len(list(store.glob("*/resp_*.json"))) == 1  # on disk before the answer came back
            await create(client, input="not kept", store=False)
            assert len(list(store.glob("*/resp_*.json"))) == 1
            durable = (await (await client.get("/stats")).get_json())["responses_store"]["durable"]
            assert durable["entries"] == 1 and durable["writes"] == 1 and durable["dir"] == str(store)
            items = await (await client.get(f"{RESPONSES}/{first['id']}/input_items")).get_json()

        worker = fast()
        async with server(worker, response_store=str(store)) as (client, handles, _):
            got = await client.get(f"{RESPONSES}/{first['id']}")
            assert got.status_code == 200 and await got.get_json() == first
            assert await (await client.get(f"{RESPONSES}/{first['id']}/input_items")).get_json() == items
            follow = await create(client, input="more", previous_response_id=first["id"])
            prompt = worker.specs[min(worker.specs)].prompt
            assert all(holds(prompt, text) for text in ("be brief", "hi", "more"))  # the stored turn, re-fed
            assert (await client.delete(f"{RESPONSES}/{first['id']}")).status_code == 200

        async with server(fast(), response_store=str(store)) as (client, handles, _):
            assert (await client.get(f"{RESPONSES}/{first['id']}")).status_code == 404  # the delete held
            assert (await client.get(f"{RESPONSES}/{follow['id']}")).status_code == 200
            missing = await client.post(
                RESPONSES, json={"model": "fake-model", "input": "x", "previous_response_id": first["id"]}
            )
            assert missing.status_code == 404
