"""A model pool over fake workers, behind the real app (the pool's MockClock tests).

Each model directory is a bare folder with a config.json; each load builds a `LoadingFakeWorker`
that spends `load_cost` virtual seconds loading and whose tokens depend on the model (its
`offset`), so a reply shows which model served it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.handles import ServerHandles
from actors.mlx_thread import MlxThread
from actors.model_catalog import ModelCatalog, Servable, model_dirs
from actors.options import options as serve_options
from actors.pool import ModelPool
from actors.pool_setup import pool_setup
from actors.root import start_actors, start_pool
from actors.worker_api import ModelInfo
from api.app import create_app
from model.load.errors import ModelLoadError
from tests.fakes import EOS, FakeTokenizer, FakeWorker, default_token

WEIGHTS = 1_000_000  # each fake model's weights, in bytes


class LoadingFakeWorker(FakeWorker):
    """A fake worker whose load takes virtual time and that says when it was unloaded."""

    def __init__(
        self, model_id: str, *, load_cost: float, offset: int, fails: bool = False, unload_cost: float = 0.0, **kw: Any
    ) -> None:
        info = ModelInfo(
            name=model_id,
            context_length=4096,
            weights_bytes=WEIGHTS,
            kv_bytes_per_token=1000,
            eos_token_ids=frozenset({EOS}),
            memory_bytes=10**12,
        )
        super().__init__(info=info, token_fn=lambda prompt, pos: default_token(prompt, pos + offset), **kw)
        self.load_cost = load_cost
        self.unload_cost = unload_cost  # how long its stop takes (an engine process's exit)
        self.fails = fails
        self.unloaded_at: float | None = None

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(self.load_cost)
        if self.fails:
            raise ModelLoadError(f"{self.info.name}: config.json names no known family")
        task_status.started(self.info)
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.unload_cost)
            self.unloaded_at = trio.current_time()


def write_model_dirs(root: Path, names: Sequence[str]) -> Path:
    """`root` holding one bare model directory per name (a config.json is all the catalog reads)."""
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return root


@attrs.frozen(eq=False)
class PoolServer:
    client: Any  # quart-trio test client
    handles: ServerHandles  # the app's (the default model's)
    pool: ModelPool
    workers: dict[str, list[LoadingFakeWorker]]  # every worker each model was loaded with

    async def statuses(self) -> dict[str, str]:
        cards = (await (await self.client.get("/v1/models")).get_json())["data"]
        return {card["id"]: card["status"] for card in cards if "status" in card}

    def worker(self, model_id: str) -> LoadingFakeWorker:
        """The worker of the model's latest load."""
        return self.workers[model_id][-1]


@asynccontextmanager
async def pool_server(
    models_dir: Path,
    *,
    size: int = 2,
    ttl_s: float = 0.0,
    load_timeout_s: float = 300.0,
    load_cost: float = 2.0,
    step_cost: float = 0.1,
    offsets: Callable[[str], int] = lambda model_id: 1000 * (sum(map(ord, model_id)) % 7),
    failing: Sequence[str] = (),
    grouped: bool = False,
    unload_cost: float = 0.0,
    **config: Any,
) -> AsyncIterator[PoolServer]:
    """`grouped`: a failing load raises its error inside an exception group, as an isolated
    model's worker does (its engine starts in a nursery)."""
    found = model_dirs(models_dir)
    catalog = ModelCatalog(Servable(found[0].id, found[0].path), models_dir=models_dir)
    workers: dict[str, list[LoadingFakeWorker]] = {}

    async def start_member(nursery: trio.Nursery, model: Servable) -> ServerHandles:
        costs = {"prefill_cost": 0.1, "join_cost": 0.1, "step_cost": step_cost}
        fails = model.id in failing
        offset = offsets(model.id)
        worker = LoadingFakeWorker(
            model.id, load_cost=load_cost, offset=offset, fails=fails, unload_cost=unload_cost, **costs
        )
        workers.setdefault(model.id, []).append(worker)
        try:
            return await start_actors(
                nursery,
                worker,
                options=serve_options(served_model_name=(model.id,), **config),
                make_tokenizer=lambda info: FakeTokenizer(),
                responses=False,
            )
        except Exception as exc:
            if grouped:
                raise ExceptionGroup("Exceptions from Trio nursery", [exc]) from None
            raise

    pool = ModelPool(catalog, start_member, size=size, ttl_s=ttl_s, load_timeout_s=load_timeout_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        handles = await pool.start()
        yield PoolServer(create_app(handles).test_client(), handles, pool, workers)
        nursery.cancel_scope.cancel()


# -- a real pool: real GPU workers on one MLX thread ------------------------------------------


@attrs.frozen(eq=False)
class RealPool:
    client: Any  # quart-trio test client
    handles: ServerHandles  # the app's (the default model's)
    pool: ModelPool
    thread: MlxThread

    async def statuses(self) -> dict[str, str]:
        cards = (await (await self.client.get("/v1/models")).get_json())["data"]
        return {card["id"]: card["status"] for card in cards if "status" in card}

    async def complete(self, model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """A greedy completion whose reply carries its token ids (`token_ids`)."""
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        response = await self.client.post("/v1/completions", json=body)
        assert response.status_code == 200, await response.get_data()
        answer: dict[str, Any] = await response.get_json()
        named = answer["choices"][0]["logprobs"]["tokens"]
        answer["token_ids"] = [int(t.removeprefix("token_id:")) for t in named]
        return answer


@asynccontextmanager
async def real_pool_server(**fields: Any) -> AsyncIterator[RealPool]:
    """A pooled server as `actors.root.start_pool` builds it (options by their flat field names:
    `model_pool=2, models_dir=...`), behind the real app."""
    setup = pool_setup(serve_options(**fields))
    async with trio.open_nursery() as nursery:
        handles, pool = await start_pool(nursery, setup)
        yield RealPool(create_app(handles).test_client(), handles, pool, setup.thread)
        nursery.cancel_scope.cancel()


def mlx_lm_tokens(model_dir: Path, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens for `prompt` on `model_dir` (the parity oracle)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    return [int(token) for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens)]
