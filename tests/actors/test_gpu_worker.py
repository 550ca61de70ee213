"""The real GPU worker: one OS thread for every MLX call, results equal the engine run inline."""

from __future__ import annotations

import threading

import pytest
import trio

from actors.gpu_worker import WorkerDied
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.errors import ModelLoadError
from model.load.loader import load_model
from tests.engine_helpers import generate_tokens
from tests.helpers.workers import gpu_worker

PROMPT = (5, 17, 42, 99, 3, 250, 11, 7)


async def test_jobs_run_on_one_thread_and_match_inline_engine(qwen3_dir):
    expected = generate_tokens(
        Engine(load_model(qwen3_dir).model, eos_token_ids=[]), [RowSpec(1, PROMPT, SamplingParams(), 12)]
    )[1]
    worker = gpu_worker(qwen3_dir, eos_token_ids=[])
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(worker.run)
            assert info.kv_bytes_per_token > 0 and info.weights_bytes > 0
            threads = set()
            for _ in range(10):  # other to_thread users must not move MLX work between threads
                nursery.start_soon(trio.to_thread.run_sync, threading.get_ident)
            await worker.open_row(RowSpec(1, PROMPT, SamplingParams(), 12))
            while (await worker.prefill(1)).remaining:
                pass
            tokens = [(await worker.join(1)).token]
            while len(tokens) < 12:
                for out in await worker.step():
                    tokens.append(out.token)
                threads.add(await worker.run_exclusive(lambda engine: threading.get_ident()))
            await worker.close_row(1, reusable=False)
            assert threads == {worker.thread_ident} and worker.thread_ident != threading.get_ident()
            nursery.cancel_scope.cancel()
    assert tokens == expected
    with pytest.raises(WorkerDied):
        await worker.step()


async def test_cancelled_caller_does_not_interrupt_the_job(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[])
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            with trio.move_on_after(0):
                await worker.open_row(RowSpec(1, PROMPT, SamplingParams(), 4))
            # the worker still answers, and its state is consistent afterwards
            rows = await worker.run_exclusive(lambda engine: engine.active_rows)
            assert rows in (0, 1)
            nursery.cancel_scope.cancel()


async def test_load_error_surfaces_from_start(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt9"}')
    worker = gpu_worker(tmp_path)
    with pytest.RaisesGroup(
        pytest.RaisesExc(ModelLoadError, match="unsupported model_type 'gpt9'"), flatten_subgroups=True
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)


async def test_a_job_whose_caller_is_cancelled_while_queued_never_runs(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[])
    release, ran = threading.Event(), []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            # hold the MLX thread in a job, queue a second one behind it, cancel its caller
            nursery.start_soon(worker.run_exclusive, lambda engine: release.wait(60))
            await trio.sleep(0.05)
            with trio.move_on_after(0.05):
                await worker.run_exclusive(lambda engine: ran.append("queued"))
            release.set()
            assert await worker.run_exclusive(lambda engine: "after") == "after"
            nursery.cancel_scope.cancel()
    assert ran == []


async def test_an_idle_thread_hands_the_buffer_cache_back(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[])
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.open_row(RowSpec(1, PROMPT, SamplingParams(), 4))
            while (await worker.prefill(1)).remaining:
                pass
            await worker.join(1)

            def leave_transients() -> int:  # freed buffers MLX keeps for reuse, as a step leaves them
                import mlx.core as mx

                mx.eval(mx.ones((1024, 1024)) * 2)
                return int(mx.get_cache_memory())

            assert await worker.thread.call(leave_transients) > 0
            released = worker.times.idle_releases
            assert worker.times.memory["cache_bytes"] > 0  # recorded after that job
            while worker.times.idle_releases == released:  # (about a second without a job)
                await trio.sleep(0.05)
            assert worker.times.memory["cache_bytes"] == 0
            assert worker.times.memory["active_bytes"] > 0  # the model and the open row stay
            assert worker.times.snapshot()["memory"] == worker.times.memory
            await trio.sleep(2 * 1.0)
            assert worker.times.idle_releases == released + 1  # once per spell of work, not per second
            nursery.cancel_scope.cancel()
