"""/stats' live-KV figures over the real actors and fake workers: the peak never passes
`--kv-budget`, whatever one request asks, and a model pool's unloaded default model leaves none."""

from __future__ import annotations

from typing import Any

from tests.api.test_api_fake import server
from tests.api.test_model_pool import text
from tests.fakes import FakeWorker
from tests.helpers.pool import PoolServer, pool_server, write_model_dirs


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


async def test_a_pool_s_default_model_once_unloaded_leaves_no_figures_in_stats(autojump_clock, tmp_path):
    """The top-level blocks are the default model's latest load while it is resident; once it has
    left the pool, nothing of it is held (rows, KV, prompt cache), so /stats and /metrics show
    none of its figures until it is loaded again."""
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    model_blocks = {"admission", "batch", "kv_quant", "speculation", "prompt_cache"}

    async def stats(server: PoolServer) -> dict[str, Any]:
        return dict(await (await server.client.get("/stats")).get_json())

    async def peak_series(server: PoolServer) -> list[str]:
        lines = (await (await server.client.get("/metrics")).get_data()).decode().splitlines()
        return [line for line in lines if line.startswith("mlx_trio:kv_cache_")]

    async with pool_server(root, size=2, kv_budget_gb=0.01) as server:
        await text(server, "a", 300)
        top = await stats(server)
        assert model_blocks <= set(top) and top["batch"]["peak_kv_bytes"] == 512 * 1000  # 4 + 300 positions
        assert await peak_series(server)
        await text(server, "b")
        await text(server, "c")  # a, the least recently used, leaves to make room
        assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        top = await stats(server)
        assert top["server"]["model"] == "a" and not model_blocks & set(top)
        assert set(top["models"]["resident"]) == {"b", "c"}
        assert await peak_series(server) == []
        await text(server, "a")  # loaded again: its new load's figures, from zero
        top = await stats(server)
        assert top["admission"]["admitted"] == 1 and top["batch"]["peak_kv_bytes"] == 256 * 1000
