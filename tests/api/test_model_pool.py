"""The model pool behind the app, on fake workers and virtual time: which model a request gets,
which one leaves to make room, and what never leaves under running rows."""

from __future__ import annotations

from typing import Any

import trio

from tests.helpers.pool import WEIGHTS, PoolServer, pool_server, write_model_dirs

PROMPT = [5, 17, 42, 99]


async def complete(server: PoolServer, model: str | None, max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    response = await server.client.post("/v1/completions", json=body)
    return response.status_code, await response.get_json()


async def text(server: PoolServer, model: str | None, max_tokens: int = 8) -> str:
    status, body = await complete(server, model, max_tokens)
    assert status == 200, body
    if model is not None:
        assert body["model"] == model
    return str(body["choices"][0]["text"])


async def test_a_third_model_evicts_the_least_recently_used_and_comes_back_on_demand(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        first_a = await text(server, "a")
        b = await text(server, "b")
        assert await server.statuses() == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        c = await text(server, "c")
        assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        assert server.worker("a").unloaded_at is not None
        again_a = await text(server, "a")  # loaded again on demand; b is now the least recently used
        assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert len(server.workers["a"]) == 2 and again_a == first_a
        top = await (await server.client.get("/stats")).get_json()
        assert top["server"]["model"] == "a" and top["admission"]["admitted"] == 1  # its latest load's
        assert (await server.client.get("/health")).status_code == 200
        assert len({first_a, b, c}) == 3  # each model answered with its own tokens
        assert await text(server, None) == first_a  # no `model`: the default
        stats = (await (await server.client.get("/stats")).get_json())["models"]
        assert (stats["loads"], stats["evictions"]) == (4, 2) and set(stats["resident"]) == {"a", "c"}


async def test_a_model_with_running_rows_is_never_evicted_under_them(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        long: dict[str, Any] = {}

        async def run_long() -> None:
            long["status"], long["body"] = await complete(server, "a", max_tokens=300)
            long["ended"] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_long)
            await trio.sleep(1)  # a's row runs; a is now the least recently used model
            await text(server, "b")
            await text(server, "c")  # the pool is full: b, idle, leaves; a, busy, stays
            assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "loaded"}
            assert server.worker("a").unloaded_at is None
        assert long["status"] == 200 and long["body"]["usage"]["completion_tokens"] == 300
        assert long["body"]["choices"][0]["finish_reason"] == "length"
        assert len(server.workers["a"]) == 1


async def test_a_full_pool_of_busy_models_makes_a_new_one_wait_then_answers_503(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2, load_timeout_s=5.0) as server:
        async with trio.open_nursery() as nursery:
            for model in ("a", "b"):
                nursery.start_soon(complete, server, model, 300)
            await trio.sleep(3)
            started = trio.current_time()
            response = await server.client.post("/v1/completions", json={"model": "c", "prompt": PROMPT})
            assert response.status_code == 503 and response.headers["Retry-After"] == "5"
            assert (await response.get_json())["error"]["code"] == "model_pool_busy"
            assert trio.current_time() - started >= 5.0
        assert await text(server, "c")  # once a row ended, the idle model made room
        assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}


async def test_concurrent_requests_to_two_models_batch_per_model_and_equal_their_solo_runs(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        solo = {model: await text(server, model, 20) for model in ("a", "b")}
        got: dict[tuple[str, int], str] = {}

        async def one(model: str, i: int) -> None:
            got[model, i] = await text(server, model, 20)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                for model in ("a", "b"):
                    nursery.start_soon(one, model, i)
        assert got == {(m, i): solo[m] for m in ("a", "b") for i in range(3)}
        for model in ("a", "b"):
            widths = [len(ids) for _, ids in server.worker(model).batches()]
            assert max(widths) == 3  # each model's requests shared its own batch
        assert len(server.workers["b"]) == 1  # three concurrent requests loaded it once


async def test_an_unknown_model_is_404_and_names_the_servable_ones(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        status, body = await complete(server, "nope")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert all(f"`{m}`" in body["error"]["message"] for m in ("a", "b", "c"))
        assert (await server.client.get("/v1/models/nope")).status_code == 404
        card = await (await server.client.get("/v1/models/b")).get_json()
        assert card["id"] == "b" and card["status"] == "unloaded"
        card = await (await server.client.get("/v1/models/a")).get_json()
        assert card["status"] == "loaded" and card["default"] is True and "context_window" in card
        assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "unloaded"}  # nothing loaded


async def test_model_ttl_unloads_an_idle_model_never_a_busy_one(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2, ttl_s=30.0) as server:
        loaded_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete, server, "b", 600)  # 60 s of decoding
            await trio.sleep(31)
            assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
            assert server.worker("a").unloaded_at == loaded_at + 30.0  # idle since it loaded
        ended = trio.current_time()
        await trio.sleep(29)
        assert (await server.statuses())["b"] == "loaded"  # idle 29 s: not yet
        await trio.sleep(2)
        assert (await server.statuses())["b"] == "unloaded"
        assert server.worker("b").unloaded_at is not None and server.worker("b").unloaded_at - ended >= 30.0
        assert (await (await server.client.get("/stats")).get_json())["models"]["expirations"] == 2
        assert await text(server, "a")  # and it loads again on demand


async def test_load_and_unload_routes(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        response = await server.client.post("/admin/models/load", json={"model": "c"})
        assert response.status_code == 200
        assert (await response.get_json())["status"] == "loaded"
        assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        missing = await server.client.post("/admin/models/load", json={"model": "nope"})
        assert missing.status_code == 404 and (await missing.get_json())["error"]["code"] == "model_not_found"

        long: dict[str, Any] = {}

        async def run_long() -> None:
            long["status"], long["body"] = await complete(server, "c", max_tokens=200)
            long["ended"] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_long)
            await trio.sleep(1)
            busy = await server.client.post("/admin/models/unload", json={"model": "c", "force": False})
            assert busy.status_code == 409 and (await busy.get_json())["error"]["code"] == "model_busy"
            unloaded = await server.client.post("/admin/models/unload", json={"model": "c"})
            assert unloaded.status_code == 200 and (await unloaded.get_json())["status"] == "unloaded"
            assert trio.current_time() >= long["ended"]  # it waited for the running row
        assert long["status"] == 200 and long["body"]["usage"]["completion_tokens"] == 200
        assert await server.statuses() == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        again = await server.client.post("/admin/models/unload", json={"model": "c"})
        assert again.status_code == 200  # not resident: nothing to do
        idle = await server.client.post("/admin/drain", json={"model": "c"})
        assert idle.status_code == 409 and (await idle.get_json())["error"]["code"] == "model_not_loaded"
        drained = await server.client.post("/admin/drain", json={"model": "a"})
        assert drained.status_code == 200 and (await drained.get_json())["demoted"] == 0  # (no SSD tier)
        assert (await server.statuses())["a"] == "loaded"


async def test_memory_admission_counts_every_resident_models_weights(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2, memory_budget_gb=0.1) as server:

        async def admission(model: str) -> dict[str, Any]:
            stats = await (await server.client.get("/stats")).get_json()
            return dict(stats["models"]["resident"][model]["admission"])

        alone = await admission("a")
        assert alone["other_models_bytes"] == 0
        await text(server, "b")
        beside = await admission("a")
        assert beside["other_models_bytes"] == WEIGHTS
        assert beside["usable_bytes"] == alone["usable_bytes"] - WEIGHTS
        assert (await admission("b"))["other_models_bytes"] == WEIGHTS
        await server.client.post("/admin/models/unload", json={"model": "b"})
        assert (await admission("a"))["usable_bytes"] == alone["usable_bytes"]


async def test_metrics_per_model(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2) as server:
        await text(server, "b", 8)
        exposition = (await (await server.client.get("/metrics")).get_data()).decode()
        for line in (
            'mlx_trio:model_loaded{model="a"} 1.0',
            'mlx_trio:model_loaded{model="b"} 1.0',
            'mlx_trio:model_loaded{model="c"} 0.0',
            'mlx_trio:model_generation_tokens_total{model="b"} 8.0',
            'mlx_trio:model_generation_tokens_total{model="a"} 0.0',
            "mlx_trio:model_pool_loads_total 2.0",
        ):
            assert line in exposition, line


async def test_a_load_that_fails_is_503_with_retry_after_and_the_next_request_tries_again(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "bad", "c"])
    async with pool_server(root, size=2, failing=("bad",)) as server:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete, server, "c")
            await trio.sleep(1)  # c is loading (2 s)
            assert await server.statuses() == {"a": "loaded", "bad": "unloaded", "c": "loading"}
        for attempts, wait in ((1, 0.0), (1, 1.0), (2, 5.0)):  # within its Retry-After: no new attempt
            await trio.sleep(wait)
            response = await server.client.post("/v1/completions", json={"model": "bad", "prompt": PROMPT})
            body = await response.get_json()
            assert response.status_code == 503 and body["error"]["code"] == "model_load_failed", body
            assert "no known family" in body["error"]["message"] and response.headers["Retry-After"] == "5"
            assert len(server.workers["bad"]) == attempts
        # its first attempt had made room (a, the least recently used, left); the repeats did not
        assert await server.statuses() == {"a": "unloaded", "bad": "unloaded", "c": "loaded"}


async def test_a_failed_load_names_its_cause_not_the_exception_group_around_it(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "bad"])
    async with pool_server(root, size=2, failing=("bad",), grouped=True) as server:
        response = await server.client.post("/v1/completions", json={"model": "bad", "prompt": PROMPT})
        message = (await response.get_json())["error"]["message"]
        assert response.status_code == 503 and "no known family" in message, message
        assert "Trio nursery" not in message


async def test_a_model_that_would_not_fit_the_memory_budget_makes_room_first(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    (root / "c" / "model.safetensors").write_bytes(b"\0" * 1_600_000)  # its weights, as the pool estimates them
    async with pool_server(root, size=3, memory_budget_gb=0.0025) as server:  # 2.5 MB: a and b take 2
        await text(server, "b")
        assert await server.statuses() == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        await text(server, "c")  # 1.6 MB beside 2: both leave, though the pool counts room for three
        assert await server.statuses() == {"a": "unloaded", "b": "unloaded", "c": "loaded"}


class _Times:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    def snapshot(self) -> dict[str, Any]:
        return {"engine_of": self.model_id}


async def test_isolated_members_each_show_their_own_engines_worker_block(autojump_clock, tmp_path):
    """Under --isolate each model's engine is a process with its own MLX thread: /stats shows
    each resident model's `worker` block, not only the default's at the top level."""
    root = write_model_dirs(tmp_path, ["a", "b"])
    async with pool_server(root, size=2, isolate=True) as server:
        assert (await complete(server, "b"))[0] == 200
        for model_id in ("a", "b"):
            server.worker(model_id).times = _Times(model_id)  # type: ignore[attr-defined]
        stats = await (await server.client.get("/stats")).get_json()
        resident = stats["models"]["resident"]
        assert resident["a"]["worker"] == {"engine_of": "a"} and resident["b"]["worker"] == {"engine_of": "b"}


async def test_concurrent_requests_for_a_new_model_evict_one_model_not_one_each(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b", "c"])
    async with pool_server(root, size=2, unload_cost=1.0) as server:
        await text(server, "b")
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(text, server, "c")
                await trio.sleep(0.1)  # (the later ones arrive while a is leaving)
        assert await server.statuses() == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        assert (await (await server.client.get("/stats")).get_json())["models"]["evictions"] == 1


async def test_a_request_waiting_for_a_load_when_shutdown_begins_gets_503_not_a_late_admission(
    autojump_clock, tmp_path
):
    """The shutdown drains the requests admitted before it; one still waiting for its model's load
    is refused like any new request, and the model that loads meanwhile admits nothing."""
    root = write_model_dirs(tmp_path, ["a", "b"])
    async with pool_server(root, size=2) as server:
        async with trio.open_nursery() as nursery:
            answers: list[int] = []

            async def waiting() -> None:
                answers.append((await complete(server, "b"))[0])

            nursery.start_soon(waiting)
            await trio.sleep(1)  # b is loading (2 s)
            server.pool.close(cutoff_after=30)
        assert answers == [503]
        b = server.pool.resident("b")
        assert b is None or b.admission.closed


class _DyingTier:
    """An SSD tier whose drain fails (an isolated engine killed during it)."""

    async def drain(self) -> Any:
        raise RuntimeError("the model's engine process died during the call")


async def test_a_drain_that_fails_reports_not_durable(autojump_clock, tmp_path):
    root = write_model_dirs(tmp_path, ["a", "b"])
    async with pool_server(root, size=2) as server:
        assert (await complete(server, "b"))[0] == 200
        handles = server.pool.resident("b")
        assert handles is not None
        handles.ssd = _DyingTier()  # type: ignore[assignment]
        drained = await (await server.client.post("/admin/drain", json={"model": "b"})).get_json()
        assert drained["durable"] is False, drained
        unloaded = await (await server.client.post("/admin/models/unload", json={"model": "b"})).get_json()
        assert unloaded["drain"]["durable"] is False, unloaded
