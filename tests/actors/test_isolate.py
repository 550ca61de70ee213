"""`--isolate` on MockClock time: the scheduler over an `IsolatedWorker` whose engines run in this
trio run (tests/helpers/isolate.py), each serving a fake worker through the real protocol.

What crosses is plain data (the codec), and rows computed across it equal the fake worker's own;
a dead engine fails the rows it held at once (not at their next call, after the restart), a
queued row opens on the next engine after the backoff, an engine that keeps dying leaves the
model failed, and a stop drains the engine."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import trio

from actors.isolate.codec import CodecError, decode, encode
from actors.isolate.protocol import EngineFailed, EngineLost
from actors.isolate.worker import RestartPolicy
from actors.messages import Abort, RowFailed, WorkerLost
from actors.startup import find
from actors.worker_api import AdapterNotMounted, ModelInfo
from model.engine.params import Constraint, SamplingParams, ThinkControl
from model.engine.rows import ImageInput, RowSpec, TokenOut, TopLogprob
from model.load.errors import ModelLoadError
from model.media import KindLayout, MediaLayout
from model.options import ServerOptions
from tests.fakes import FakeWorker, scheduler_harness
from tests.helpers.isolate import KILLED, isolated


def test_the_codec_round_trips_plain_data_and_refuses_the_rest():
    pixels = np.arange(24, dtype=np.float32).reshape(4, 6)
    spec = RowSpec(
        7,
        (1, 2, 3),
        SamplingParams(
            temperature=0.5,
            logit_bias=((3, -1.5),),
            constraint=Constraint("json_schema", '{"type": "object"}', strict=True),
            think=ThinkControl(10, 11, separator=(12,), budget=5),
        ),
        max_tokens=9,
        retain=((2, 300.0),),
        adapters=("a",),
        images=(ImageInput(pixels, (1, 2, 3), "sha", runs=(4,)),),
    )
    info = ModelInfo(
        name="m",
        context_length=8,
        weights_bytes=1,
        kv_bytes_per_token=2,
        eos_token_ids=frozenset({0, 5}),
        kv_bits=(4, None),
        generation_defaults=(("temperature", 0.6),),
        media_layout=MediaLayout((("image", KindLayout((9, 10), 10)),)),
    )
    token = TokenOut(7, 42, "length", -0.25, (TopLogprob(42, -0.25), TopLogprob(3, -math.inf)))
    message = {"v": [spec, info, token, {"k": [1, (2,)]}, None, float("nan")]}
    text, blobs = encode(message)
    back = decode(text, blobs)["v"]
    assert back[:3] == [spec, info, token]
    assert np.array_equal(back[0].images[0].pixels, pixels) and back[0].images[0].pixels.dtype == np.float32
    assert back[3] == {"k": [1, (2,)]} and back[4] is None and math.isnan(back[5])
    assert type(back[0].prompt) is tuple and type(back[1].eos_token_ids) is frozenset
    options = decode(*encode({"o": ServerOptions()}))["o"]
    assert options == ServerOptions()

    with pytest.raises(CodecError):
        encode({"v": object()})
    with pytest.raises(CodecError):  # only the listed classes are ever built
        decode(b'{"v": {"@": "Popen", "args": "rm"}}', [])


async def _run_rows(worker, capacity=4, group=0, rows=((1, (5, 6, 7), 6), (2, (8, 9), 4), (3, (1,) * 9, 5))):
    async with scheduler_harness(worker, capacity=capacity, group_prefill_tokens=group) as harness:
        logs = {row_id: harness.submit(row_id, prompt, n) for row_id, prompt, n in rows}
        while any(log.ended_at is None for log in logs.values()):
            await trio.sleep(1)
    return {row_id: log.tokens for row_id, log in logs.items()}


async def test_rows_across_the_socket_equal_the_fake_workers_own(autojump_clock):
    reference = FakeWorker()
    expected = await _run_rows(reference)
    for group in (0, 16):  # one at a time, and a group prefill
        async with trio.open_nursery() as nursery:
            worker, engines = isolated(nursery)
            await nursery.start(worker.run)
            assert worker.info == reference.info
            assert await _run_rows(worker, group=group) == expected
            fake = engines.last.worker
            assert isinstance(fake, FakeWorker) and fake.violations == [] and not fake.rows
            assert group == 0 or any(call == "prefill_group" for _, call, _ in fake.calls)
            nursery.cancel_scope.cancel()


async def test_a_dead_engine_fails_its_rows_at_once_and_queued_rows_run_on_the_next(autojump_clock):
    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery, lambda: FakeWorker(open_cost=1.0), policy=RestartPolicy(backoff_s=5.0))
        await nursery.start(worker.run)
        fake = engines.last.worker
        assert isinstance(fake, FakeWorker)
        async with scheduler_harness(worker, capacity=2) as harness:
            worker.on_lost = lambda error: harness.inbox.send_nowait(WorkerLost(error))
            decoding = [harness.submit(1, (1, 2), 50)]
            while len(decoding[0].tokens) < 3:
                await trio.sleep(0.1)
            decoding.append(harness.submit(2, (7, 8, 9), 50))
            while len(decoding[1].tokens) < 2:
                await trio.sleep(0.1)
            opening = harness.submit(3, (3, 4, 5), 4)  # (capacity 2: it waits for a free row)
            queued = harness.submit(4, (6, 5, 4), 4)
            await trio.sleep(0)
            harness.inbox.send_nowait(Abort(2))  # row 3 opens: its open_row is in flight at the kill
            while not (fake.calls[-1][1] == "open_row" and fake.calls[-1][2] == 3):
                await trio.sleep(0.1)
            killed = trio.current_time()
            engines.last.kill()  # row 1 is in no call: only `on_lost` can end it before the restart
            while any(log.ended_at is None for log in (*decoding, opening, queued)):
                await trio.sleep(0.1)
        failed_at, failure = decoding[0].events[-1]
        assert isinstance(failure, RowFailed) and failure.status == 503, failure
        assert "engine process died" in failure.message
        assert failed_at - killed < 0.5  # (its stream ends on it), not after the restart
        for log, prompt in ((opening, (3, 4, 5)), (queued, (6, 5, 4))):  # both on the next engine
            assert log.tokens == FakeWorker().expected(prompt, 4)
            assert log.events[0][0] >= killed + 5.0
        assert len(engines.started) == 2 and await engines.started[0].wait() == KILLED
        assert worker.state == "serving" and worker.restarts == 1
        nursery.cancel_scope.cancel()


async def test_an_engine_that_keeps_dying_leaves_the_model_failed(autojump_clock):
    policy = RestartPolicy(max_restarts=2, backoff_s=1.0, stable_s=60.0)
    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery, policy=policy)
        await nursery.start(worker.run)
        started = trio.current_time()
        for _ in range(3):
            engines.last.kill()
            while worker.state != "serving" and worker.state != "failed":
                await trio.sleep(0.05)
            await trio.sleep(1)
            if worker.state == "failed":
                break
            while worker.state != "serving":
                await trio.sleep(0.05)
        while worker.state != "failed":
            await trio.sleep(0.1)
        assert len(engines.started) == 3  # the first and two restarts
        assert trio.current_time() - started >= 1.0 + 2.0  # backoffs of 1 s, then 2 s
        assert worker.failure is not None and "gave up after 2 restarts" in worker.failure
        assert "killed by SIGKILL" in worker.failure
        with pytest.raises(EngineFailed) as failed:
            await worker.open_row(RowSpec(1, (1,), SamplingParams(), 2))
        assert failed.value.status == 503
        nursery.cancel_scope.cancel()


async def test_a_stable_engine_starts_the_count_again(autojump_clock):
    policy = RestartPolicy(max_restarts=1, backoff_s=0.5, stable_s=10.0)
    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery, policy=policy)
        await nursery.start(worker.run)
        for _ in range(3):  # each death comes after 20 s of serving: never two in a row
            await trio.sleep(20)
            engines.last.kill()
            await trio.sleep(1)
            assert worker.state == "serving"
        assert len(engines.started) == 4
        nursery.cancel_scope.cancel()


async def test_a_model_that_cannot_load_fails_start_up_with_its_reason(autojump_clock):
    class CannotLoad(FakeWorker):
        async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
            raise ModelLoadError("/models/fake: config.json names no known family")

    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery, CannotLoad)
        with pytest.raises(BaseException) as raised:
            await worker.run()
        assert "no known family" in str(find(raised.value, ModelLoadError))
        assert await engines.last.wait() == 2  # a usage error: the server exits 2 as well


async def test_a_stop_drains_the_engine_and_it_exits_0(autojump_clock):
    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery)
        async with trio.open_nursery() as serving:
            serving.start_soon(worker.run)
            await trio.sleep(1)
            assert worker.alive
            serving.cancel_scope.cancel()
        assert trio.current_time() < 2  # (stopped at once: no kill after the stop timeout)
        assert worker.state == "stopped" and await engines.last.wait() == 0
        with pytest.raises(EngineLost.__mro__[1]):  # WorkerDied: the stopped worker takes no call
            await worker.step()


async def test_other_calls_errors_and_aborts_cross(autojump_clock):
    async with trio.open_nursery() as nursery:
        worker, engines = isolated(nursery, lambda: FakeWorker(prefill_cost=10.0))
        await nursery.start(worker.run)
        fake = engines.last.worker
        assert isinstance(fake, FakeWorker)
        report = await worker.mount_adapter("style", "/adapters/style")
        assert report.id == "style" and fake.adapters["style"] == report
        with pytest.raises(AdapterNotMounted):
            await worker.open_row(RowSpec(1, (1, 2), SamplingParams(), 2, adapters=("nope",)))
        with pytest.raises(ValueError):
            await worker.mount_adapter("bad", "/adapters/bad")

        await worker.open_row(RowSpec(2, tuple(range(40)), SamplingParams(), 2))
        async with trio.open_nursery() as prefill:
            prefill.start_soon(worker.prefill, 2)
            await trio.sleep(1)
            worker.abort(2)  # (not a call: it reaches the engine while the prefill runs)
        assert trio.current_time() < 5 and 2 in fake.aborts
        await worker.close_row(2, reusable=False)

        engines.last.kill()  # the mount is made again on the new engine
        while worker.state != "serving" or len(engines.started) < 2:
            await trio.sleep(0.1)
        renewed = engines.last.worker
        assert isinstance(renewed, FakeWorker) and list(renewed.adapters) == ["style"]
        nursery.cancel_scope.cancel()


def test_the_fake_engine_keeps_its_options():
    options = ServerOptions()
    assert attrs.evolve(options, engine=attrs.evolve(options.engine, isolate=True)).engine.isolate
