"""The durability actor on virtual time: debounce, busy re-arm, exact-token records, retries,
vanished entries, and the single-flight flush.

FakeStore: begin / each of 2 pieces / end of pieces / commit cost 0.1 s each → 0.5 s per write.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio

from actors.ssd.durability import Durability
from actors.ssd.spill_queue import SpillQueue
from tests.helpers.ssd_fakes import FakePort, FakeStore

A = tuple(range(10, 20))
B = tuple(range(30, 40))  # same length as A, unrelated


async def settle() -> None:
    for _ in range(10):
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def tier(*, busy=lambda: False, cap_bytes=10**6):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=cap_bytes, idle=lambda: not busy(), run_blocking=store.run_blocking)
    durability = Durability(port, spills, busy=busy)
    async with trio.open_nursery() as nursery:
        await nursery.start(spills.run)
        await nursery.start(durability.run)
        yield store, port, spills, durability
        nursery.cancel_scope.cancel()


def snapshot_times(port):
    return [t for t, _ in port.snapshots]


async def test_a_put_is_written_one_second_after_its_last_mark(autojump_clock):
    async with tier() as (store, port, spills, durability):
        port.put(A)
        durability.listener("", A)  # what the worker's put hook delivers
        await trio.sleep(0.5)
        durability.mark("", A)  # re-put of the same entry: the debounce restarts
        assert durability.pending_snapshots == 1
        await trio.sleep(3)
        assert snapshot_times(port) == [1.5]
        assert store.commits() == [(pytest.approx(2.0), A)]
        assert durability.pending_snapshots == 0 and durability.counters.stored == 1


async def test_equal_length_unrelated_prompts_do_not_cancel_each_other(autojump_clock):
    async with tier() as (store, port, spills, durability):
        port.put(A)
        port.put(B)
        durability.mark("", A)
        await trio.sleep(0.5)
        durability.mark("", B)
        await trio.sleep(3)
        assert port.snapshots == [(1.0, A), (1.5, B)]
        assert sorted(t for _, t in store.commits()) == sorted([A, B])


async def test_a_fast_final_put_does_not_cancel_the_boundary_snapshot(autojump_clock):
    boundary, final = A, A + (1, 2, 3)
    async with tier() as (store, port, spills, durability):
        port.put(boundary)
        durability.mark("", boundary)
        await trio.sleep(0.2)
        port.put(final)  # the RAM tier keeps both here (say the final entry is untrimmable)
        durability.mark("", final)
        await trio.sleep(3)
        assert {t for _, t in store.commits()} == {boundary, final}


async def test_busy_engine_re_arms_every_five_seconds(autojump_clock):
    busy_until = 7.0
    async with tier(busy=lambda: trio.current_time() < busy_until) as (store, port, spills, durability):
        port.put(A)
        durability.mark("", A)
        await trio.sleep(20)
        # fired at 1 (busy) → 6 (busy) → 11 (idle): snapshot, then the write
        assert snapshot_times(port) == [11.0]
        assert durability.counters.busy_rearms == 2
        assert store.commits() == [(pytest.approx(11.5), A)]


async def test_idle_gating_holds_a_write_that_a_request_interrupts(autojump_clock):
    busy = [False]
    async with tier(busy=lambda: busy[0]) as (store, port, spills, durability):
        port.put(A)
        durability.mark("", A)
        await trio.sleep(1.15)  # snapshot at 1.0, begin 1.0-1.1, first piece under way
        busy[0] = True
        await trio.sleep(5)
        pieces = [t for t, what, _ in store.log if what == "piece"]
        assert len(pieces) == 1  # the second piece waits for the engine
        busy[0] = False
        await trio.sleep(1)
        assert len(store.commits()) == 1


async def test_a_failed_write_stays_dirty_and_a_flush_retries_it(autojump_clock):
    async with tier() as (store, port, spills, durability):
        store.fail_tokens.add(A)
        port.put(A)
        durability.mark("", A)
        await trio.sleep(2)
        assert spills.counters.failed == 1 and durability.pending_snapshots == 1  # still dirty
        store.fail_tokens.clear()
        result = await durability.flush()
        assert result.durable and result.flushed_snapshots == 1 and result.pending_snapshots == 0
        assert store.commits() == [(pytest.approx(2.5), A)]


async def test_a_dropped_spill_stays_dirty_and_is_retried(autojump_clock):
    async with tier(cap_bytes=0) as (store, port, spills, durability):
        for n in range(3):
            port.put(A[: n + 5])
            durability.mark("", A[: n + 5])
        port.put(B)
        durability.mark("", B)
        await trio.sleep(1.01)  # all four fire at once: the cap (0) drops the middle ones
        await trio.sleep(30)
        assert spills.counters.dropped >= 1
        assert durability.pending_snapshots == 0  # the retries stored every one
        assert {t for _, t in store.commits()} >= {A[:7], B}


async def test_flush_is_single_flight(autojump_clock):
    async with tier() as (store, port, spills, durability):
        port.put(A)
        port.put(B)
        durability.mark("", A)
        durability.mark("", B)
        results = []

        async def flush():
            results.append(await durability.flush())

        async with trio.open_nursery() as callers:
            callers.start_soon(flush)
            callers.start_soon(flush)
        assert len(results) == 2 and results[0] is results[1]
        assert results[0].durable and results[0].flushed_snapshots == 2
        assert len(port.snapshots) == 2 and len(store.commits()) == 2
        # forced: written back to back, no debounce, one at a time (drained after each)
        assert [t for t, _ in store.commits()] == pytest.approx([0.5, 1.0])
        assert results[0].elapsed_ms == pytest.approx(1000)


async def test_flush_writes_through_a_busy_engine(autojump_clock):
    async with tier(busy=lambda: True) as (store, port, spills, durability):
        port.put(A)
        durability.mark("", A)
        result = await durability.flush()
        assert result.durable and len(store.commits()) == 1


async def test_flush_waits_for_an_attempt_in_flight(autojump_clock):
    async with tier() as (store, port, spills, durability):
        port.put(A)
        durability.mark("", A)
        await trio.sleep(1.2)  # the timer's attempt is mid-write
        result = await durability.flush()
        assert result.durable and result.pending_spills == 0
        assert len(store.commits()) == 1 and trio.current_time() == pytest.approx(1.5)


async def test_an_entry_gone_from_ram_and_disk_is_missing_and_not_durable(autojump_clock):
    async with tier() as (store, port, spills, durability):
        durability.mark("", A)  # put, then evicted before it could be written
        result = await durability.flush()
        assert not result.durable and result.missing_snapshots == 1 and result.pending_snapshots == 0


async def test_a_superseded_ancestor_is_covered_by_its_descendant(autojump_clock):
    longer = A + (7, 8, 9)
    async with tier() as (store, port, spills, durability):
        durability.mark("", A)  # the boundary snapshot, already superseded in RAM by `longer`
        await trio.sleep(0.2)
        port.put(longer)
        durability.mark("", longer)
        await trio.sleep(10)
        # A fired first (t=1): gone from RAM, not on disk, but a longer dirty record covers it
        # → deferred, not missing; once `longer` is stored, A's retry finds it durable.
        assert durability.counters.missing == 0 and durability.pending_snapshots == 0
        assert [t for _, t in store.commits()] == [longer]


async def test_flush_stores_descendants_first_so_ancestors_are_covered(autojump_clock):
    longer = A + (7, 8, 9)
    async with tier() as (store, port, spills, durability):
        durability.mark("", A)
        port.put(longer)
        durability.mark("", longer)
        result = await durability.flush()
        assert result.durable and result.flushed_snapshots == 2 and result.missing_snapshots == 0
        assert [t for _, t in store.commits()] == [longer]


async def test_already_durable_entries_are_not_written_again(autojump_clock):
    async with tier() as (store, port, spills, durability):
        store.files[("", A + (1,))] = 100  # restored from disk, say, or written before
        port.put(A)
        durability.mark("", A)
        await trio.sleep(3)
        assert port.snapshots == [] and durability.pending_snapshots == 0


async def test_namespaces_are_separate_records(autojump_clock):
    async with tier() as (store, port, spills, durability):
        port.put(A, "adapter-x")
        port.put(A, "")
        durability.mark("adapter-x", A)
        durability.mark("", A)
        await trio.sleep(3)
        assert {k for k in store.files} == {("adapter-x", A), ("", A)}


async def test_an_entry_the_store_refuses_is_not_retried_forever(autojump_clock):
    async with tier() as (store, port, spills, durability):
        store.max_bytes = 50
        port.put(A, nbytes=100)
        durability.mark("", A)
        await trio.sleep(100)
        assert len(port.snapshots) == 1 and durability.pending_snapshots == 0
        assert durability.counters.missing == 1
