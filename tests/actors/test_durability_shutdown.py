"""Shutdown with the SSD tier, on virtual time: admission closes → in-flight rows finish (their
puts are marked) → HTTP done → timers stop and the durability flush runs while the worker is
still alive → the actors stop → flush hooks → return (the flush result is run_server's value).
Also the admin flush route and the /stats ssd_cache block, through the app."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio

from actors.options import options as serve_options
from actors.root import run_server
from actors.shutdown import Shutdown, ShutdownPlan
from tests.fakes import FakeTokenizer
from tests.helpers.shutdown import fake_http, names, order_is, streamer
from tests.helpers.ssd_fakes import FakeStore, SsdFakeWorker


async def run(worker, clients, *, timeout, signals_at, demote_idle_s=300.0):
    events = []

    def note(what):
        events.append((trio.current_time(), what))

    async def hook():
        note("flush")

    shutdown = Shutdown()
    # (no durable Responses store: it would open a directory under /fake)
    config = serve_options(
        shutdown_timeout=timeout, ssd_cache_dir="/fake", ssd_demote_idle_s=demote_idle_s, response_store="memory"
    )
    out = {}

    async def serve():
        out["result"] = await run_server(
            worker,
            options=config,
            make_tokenizer=lambda info: FakeTokenizer(),
            serve_http=fake_http(
                [partial(c, note) for c in clients], graceful=ShutdownPlan.for_options(config).http_deadline, note=note
            ),
            shutdown=shutdown,
            flush_hooks=[hook],
            trace=note,
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        for at in signals_at:
            await trio.sleep_until(at)
            note("signal")
            shutdown.request()
    note("returned")
    return events, out["result"]


def times_of(events):
    return {name: t for (t, _), name in zip(events, names(events))}


async def test_shutdown_flushes_finished_rows_before_the_actors_stop(autojump_clock):
    store = FakeStore(call_cost=0.1)
    worker = SsdFakeWorker(store)  # join 1 s + 1 s per step: 5 tokens end at t=5
    events, result = await run(worker, [streamer(5)], timeout=30, signals_at=[2])
    times = times_of(events)
    assert order_is(
        events,
        "signal",
        "admission closed",
        "stream ended",
        "http done",
        "durability flushed",
        "actors stopped",
        "flush",
        "returned",
    )
    # The row's put (t=5) was marked, and the flush wrote it at once (no 1 s debounce): the
    # snapshot job ran on the still-running worker, then 5 store calls of 0.1 s.
    assert [t for t, _ in store.commits()] == [pytest.approx(5.5)]
    assert times["durability flushed"] == pytest.approx(5.5)
    assert result.durable and result.flushed_snapshots == 1 and result.pending_snapshots == 0
    assert not worker.violations


async def test_a_flush_that_overruns_the_shutdown_timeout_is_not_durable(autojump_clock):
    store = FakeStore(call_cost=10.0)  # a very slow disk
    worker = SsdFakeWorker(store)
    events, result = await run(worker, [streamer(5)], timeout=3, signals_at=[2])
    times = times_of(events)
    assert times["http done"] == 5 and times["actors stopped"] == pytest.approx(8)  # + timeout
    assert not result.durable and result.pending_snapshots == 1
    assert store.commits() == []


async def test_a_second_signal_cuts_the_flush_short(autojump_clock):
    store = FakeStore(call_cost=10.0)
    worker = SsdFakeWorker(store)
    events, result = await run(worker, [streamer(5)], timeout=30, signals_at=[2, 7])
    times = times_of(events)
    assert order_is(events, "signal", "http done", "hard cancel", "actors stopped", "returned")
    assert times["actors stopped"] == 7
    assert not result.durable


async def test_nothing_dirty_is_durable_at_once(autojump_clock):
    worker = SsdFakeWorker(FakeStore())
    events, result = await run(worker, [], timeout=30, signals_at=[1])
    assert result.durable and times_of(events)["returned"] == 1


async def test_demotion_timer_stops_before_the_flush(autojump_clock):
    worker = SsdFakeWorker(FakeStore())
    events, result = await run(worker, [streamer(5)], timeout=30, signals_at=[2], demote_idle_s=1)
    assert worker.port.demote_calls == []  # interval 30 s: never reached; and stopped at t=5
    assert result.durable


def admin_client(requests):
    async def client(note, http):
        for method, path in requests:
            response = await http.open(path, method=method)
            note((path, response.status_code, json.loads(await response.get_data())))

    return client


async def test_admin_flush_route_and_stats_block(autojump_clock):
    store = FakeStore(call_cost=0.1)
    worker = SsdFakeWorker(store)

    async def chat_then_flush(note, http):
        response = await http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        assert response.status_code == 200
        await trio.sleep(0.01)  # the row's close (and put) follows its last token
        for path, method in (("/admin/cache/flush", "POST"), ("/stats", "GET")):
            r = await http.open(path, method=method)
            note((path, r.status_code, json.loads(await r.get_data())))
        store.fail_tokens.update(t for _, t in list(worker.port.ram))
        worker.port.put((1, 2, 3))
        store.fail_tokens.add((1, 2, 3))
        worker.listener("", (1, 2, 3))
        r = await http.post("/admin/cache/flush")
        note(("/admin/cache/flush (failing disk)", r.status_code, json.loads(await r.get_data())))

    events, result = await run(worker, [chat_then_flush], timeout=30, signals_at=[20])
    notes = {what[0]: what[1:] for _, what in events if isinstance(what, tuple)}
    status, body = notes["/admin/cache/flush"]
    assert status == 200 and body["durable"] is True and body["flushedSnapshots"] == 1
    assert set(body) == {
        "durable",
        "flushedSnapshots",
        "missingSnapshots",
        "pendingSnapshots",
        "pendingSpills",
        "pendingSpillBytes",
        "droppedSpills",
        "failedSpills",
        "elapsedMs",
        "entries",
        "longest_durable_prefix_tokens",
    }
    assert body["entries"] == 1 and body["longest_durable_prefix_tokens"] > 3
    status, stats = notes["/stats"]
    ssd = stats["ssd_cache"]
    for key in (
        "dir",
        "entries",
        "bytes",
        "max_bytes",
        "restores",
        "spills",
        "restore_ms_last",
        "demotions",
        "pending_snapshots",
        "pending_spills",
        "pending_spill_bytes",
        "dropped_spills",
        "failed_spills",
        "longest_durable_prefix_tokens",
    ):
        assert key in ssd
    assert ssd["entries"] == 1 and ssd["pending_snapshots"] == 0
    status, body = notes["/admin/cache/flush (failing disk)"]
    assert status == 503 and body["durable"] is False and body["pendingSnapshots"] == 1
    assert body["failedSpills"] >= 1
    assert not result.durable  # the failing entry is still dirty at shutdown
