"""The real worker thread and engine under the scheduler: an abort in the middle of a long prefill
chunk frees the worker within about one layer's work, not at the end of the chunk.

The model is a tiny one with many layers (tests/fixtures) and the chunk is long enough that one
takes over a second on a CPU while a layer of it takes tens of milliseconds. The bound asserted
is generous for a loaded CI box; the measured numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import random
import time

import trio

from actors.messages import Abort
from model.engine.params import SamplingParams
from model.engine.rows import RowOpened, RowSpec, TokenOut
from tests.fakes import scheduler_harness
from tests.helpers.workers import gpu_worker

LAYERS = 24
CHUNK = 768
BOUND_S = 0.5  # abort -> the next request's row opened


async def test_an_abort_mid_chunk_lets_the_next_request_start_at_once(tiny_model_factory):
    worker = gpu_worker(tiny_model_factory("qwen3", num_hidden_layers=LAYERS), eos_token_ids=[], prefill_chunk=CHUNK)
    rng = random.Random(3)
    long_prompt = tuple(rng.randrange(3, 500) for _ in range(2 * CHUNK + 1))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            # What one whole chunk of this prompt takes here (it also meets every kernel once).
            started = time.perf_counter()
            await worker.open_row(RowSpec(100, long_prompt, SamplingParams(), 1))
            await worker.prefill(100)
            full_chunk_s = time.perf_counter() - started
            await worker.close_row(100, reusable=False)
            prefill_busy = worker.times.busy_s["prefill"]

            async with scheduler_harness(worker, capacity=1) as h:  # type: ignore[arg-type]
                h.submit(1, long_prompt, max_tokens=4, collect=False)
                assert isinstance(await h.receivers[1].receive(), RowOpened)
                await trio.sleep(full_chunk_s / 4)  # a quarter into its first chunk
                aborted_at = time.perf_counter()
                h.receivers[1].close()
                h.inbox.send_nowait(Abort(1))
                h.submit(2, (5,), max_tokens=1, collect=False)  # nothing to prefill: opens, then joins
                assert isinstance(await h.receivers[2].receive(), RowOpened)
                waited_s = time.perf_counter() - aborted_at
                aborted_job_s = worker.times.busy_s["prefill"] - prefill_busy
                assert isinstance(await h.receivers[2].receive(), TokenOut)
            nursery.cancel_scope.cancel()
    print(
        f"\nfull {CHUNK}-token chunk {full_chunk_s:.3f} s; aborted a quarter in: its job ran "
        f"{aborted_job_s:.3f} s, the next row opened {waited_s * 1000:.0f} ms after the abort"
    )
    assert h.scheduler.counters.aborted_rows == 1
    assert aborted_job_s < 0.75 * full_chunk_s  # the chunk was cut short, not run to its end
    assert waited_s < BOUND_S
