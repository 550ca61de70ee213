"""/stats' live-KV figures over the real actors and a FakeWorker: the peak never passes
`--kv-budget`, whatever one request asks."""

from __future__ import annotations

from tests.api.test_api_fake import server
from tests.fakes import FakeWorker


async def test_a_lone_row_asking_for_more_than_the_kv_budget_never_passes_it(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)  # 1000 bytes of KV a token
    async with server(worker, kv_budget_gb=0.001) as (client, _, _):  # 1000 tokens' worth
        body = {"prompt": "abcd", "max_tokens": 5000}
        result = await (await client.post("/v1/completions", json=body)).get_json()
        batch = (await (await client.get("/stats")).get_json())["batch"]
    assert result["choices"][0]["finish_reason"] == "length"
    # Clamped to the three whole growth steps (768 positions) the budget holds, not to 1000
    # tokens, whose fourth step of buffers would hold 1024 positions.
    assert result["usage"]["total_tokens"] == 768
    assert batch["kv_budget_bytes"] == 1_000_000
    assert 0 < batch["peak_kv_bytes"] <= batch["kv_budget_bytes"]
