"""The model pool on real engines: three tiny models under --models-dir, two resident at once, all
on one MLX thread. Each model's greedy tokens equal mlx-lm's on its weights, before and after it
was evicted; two resident models batch their own rows side by side; and with --ssd-cache a model
evicted and loaded again serves a prompt it saw before from the SSD tier (the warm return)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.e2e.server_process import Server
from tests.helpers.pool import mlx_lm_tokens, real_pool_server

LIMIT_S = 240
PROMPT = [5, 17, 42, 99, 3, 250, 11, 7]
N = 12


@pytest.fixture(scope="module")
def models_dir(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """a, b: qwen3 of two seeds; c: llama (the catalog names each by its directory's name)."""
    root = tmp_path_factory.mktemp("models")
    made = {
        "a": tiny_model_factory("qwen3", seed=1),
        "b": tiny_model_factory("qwen3", seed=2),
        "c": tiny_model_factory("llama", template="llama3", seed=3),
    }
    for name, path in made.items():
        (root / name).symlink_to(path, target_is_directory=True)
    return root


async def test_three_models_two_resident_each_equal_to_mlx_lm(models_dir: Path) -> None:
    expected = {name: mlx_lm_tokens(models_dir / name, PROMPT, N) for name in "abc"}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the models differ: a mix-up shows
    with trio.fail_after(LIMIT_S):
        async with real_pool_server(model_pool=2, models_dir=str(models_dir), batch=4) as server:
            assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
            for name in "abc":
                answer = await server.complete(name, PROMPT, N)
                assert answer["token_ids"] == expected[name] and answer["model"] == name
            assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}
            again = await server.complete("a", PROMPT, N)  # evicted, loaded again on demand
            assert again["token_ids"] == expected["a"]
            assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "loaded"}

            # c and a resident: two rows each, all four at once, each equal to its solo run
            prompts = [PROMPT, [300, 2, 77, 9, 1]]
            solo = {(m, i): (await server.complete(m, p, N))["token_ids"] for m in "ac" for i, p in enumerate(prompts)}
            together: dict[tuple[str, int], list[int]] = {}

            async def one(model: str, i: int) -> None:
                together[model, i] = (await server.complete(model, prompts[i], N))["token_ids"]

            steps_before = {m: _steps(server, m) for m in "ac"}
            async with trio.open_nursery() as nursery:
                for key in solo:
                    nursery.start_soon(one, *key)
            assert together == solo
            for m in "ac":  # each model decoded its two rows as one batch (apart: 2 * (N - 1) steps)
                assert _steps(server, m) - steps_before[m] <= N + 1
            ident = server.thread.thread_ident  # one MLX thread for every model
            assert ident is not None
            resident = [server.pool.resident(m) for m in "ac"]
            assert all(h is not None and getattr(h.worker, "thread_ident", None) == ident for h in resident)


async def test_an_unloaded_model_gives_its_weights_and_prompt_cache_back(models_dir: Path) -> None:
    with trio.fail_after(LIMIT_S):
        async with real_pool_server(model_pool=2, models_dir=str(models_dir)) as server:
            await server.complete("a", PROMPT * 20, N)  # the default, whose first load the app holds
            while True:  # (the finished row's KV reaches the prompt cache just after its reply)
                stats = (await (await server.client.get("/stats")).get_json())["models"]["resident"]["a"]
                if stats["prompt_cache"]["bytes"]:
                    break
                await trio.sleep(0.01)
            held = stats["weights_bytes"] + stats["prompt_cache"]["bytes"]
            before = await server.thread.call(_active_memory)
            response = await server.client.post("/admin/models/unload", json={"model": "a"})
            assert response.status_code == 200
            assert before - await server.thread.call(_active_memory) >= held


def _active_memory() -> int:
    import mlx.core as mx

    return int(mx.get_active_memory())


def _steps(server: Any, model: str) -> int:
    handles = server.pool.resident(model)
    return int(handles.scheduler.counters.steps)


async def test_warm_return_from_the_ssd_tier_after_an_eviction(models_dir: Path, tmp_path: Path) -> None:
    long_prompt = [(i * 37) % 400 + 3 for i in range(600)]
    with trio.fail_after(LIMIT_S):
        flags = {"model_pool": 2, "models_dir": str(models_dir), "ssd_cache_dir": str(tmp_path / "ssd")}
        async with real_pool_server(**flags) as server:
            cold = await server.complete("a", long_prompt, N)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await server.complete("b", PROMPT, N)
            await server.complete("c", PROMPT, N)  # a leaves: its prompt cache goes to the SSD tier first
            assert (await server.statuses())["a"] == "unloaded"
            warm = await server.complete("a", long_prompt, N)
            cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 0.9 * len(long_prompt), cached
            assert warm["token_ids"] == cold["token_ids"]
            stats = (await (await server.client.get("/stats")).get_json())["models"]["resident"]["a"]
            assert stats["ssd_cache"]["restores"] == 1


async def test_drain_by_hand_demotes_the_prompt_cache_and_keeps_the_model(models_dir: Path, tmp_path: Path) -> None:
    long_prompt = [(i * 37) % 400 + 3 for i in range(300)]
    with trio.fail_after(LIMIT_S):
        flags = {"model_pool": 2, "models_dir": str(models_dir), "ssd_cache_dir": str(tmp_path / "ssd")}
        async with real_pool_server(**flags) as server:
            cold = await server.complete("a", long_prompt, N)
            response = await server.client.post("/admin/drain", json={"model": "a"})
            assert response.status_code == 200
            drained = await response.get_json()
            assert drained["demoted"] >= 1 and drained["ssdEntries"] >= 1 and drained["durable"] is True
            assert (await server.statuses())["a"] == "loaded"
            stats = (await (await server.client.get("/stats")).get_json())["models"]["resident"]["a"]
            assert stats["prompt_cache"]["entries"] == 0  # the RAM tier is empty: the next hit is the SSD's
            warm = await server.complete("a", long_prompt, N)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(long_prompt)
            assert warm["token_ids"] == cold["token_ids"]


def test_the_command_line_serves_a_pool_and_ctrl_c_flushes_every_model(models_dir: Path, tmp_path: Path) -> None:
    args = ("--models-dir", str(models_dir), "--model-pool", "2", "--ssd-cache", str(tmp_path / "ssd"))
    server = Server(models_dir / "a", *args)
    try:
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
        for model in ("a", "b"):
            reply = server.client.post("/v1/completions", json={**body, "model": model})
            assert reply.status_code == 200 and reply.json()["model"] == model
        models = {card["id"]: card["status"] for card in server.client.get("/v1/models").json()["data"]}
        assert models == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        missing = server.client.post("/v1/completions", json={**body, "model": "nope"})
        assert missing.status_code == 404
        assert server.stop() == 0
    finally:
        server.kill()
    assert server.log.count("shutdown flush: durable") == 2, server.log  # one per resident model
    assert '"model": "b"' in server.log  # the request log names the model
