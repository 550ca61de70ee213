"""The spill-queue actor on virtual time: idle gating per piece, the byte cap, counters, drain.

FakeStore: every blocking call (begin, each piece, commit) costs 0.1 s; an item has 2 pieces,
so an ungated write takes begin 0.1 + 2 pieces 0.2 + the final write_next 0.1 + commit 0.1.
"""

from __future__ import annotations

import pytest
import trio

from actors.ssd.spill_queue import SpillQueue
from tests.helpers.ssd_fakes import FakeItem, FakeStore


async def settle() -> None:
    for _ in range(5):
        await trio.lowlevel.checkpoint()


def item(n: int, nbytes: int = 100, ns: str = "") -> FakeItem:
    return FakeItem(ns, tuple(range(n)), nbytes)


async def test_writes_serially_and_reports_each_outcome(autojump_clock):
    store = FakeStore()
    q = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        results = []

        async def submit(it):
            results.append((await q.submit(it), it.tokens, trio.current_time()))

        a, b = item(3), item(4)
        nursery.start_soon(submit, a)
        nursery.start_soon(submit, b)
        await settle()
        assert q.pending == 2 and q.pending_bytes == 200
        await q.drain()
        nursery.cancel_scope.cancel()
    # begin .1, pieces .2, end-of-pieces .1, commit .1 → 0.5 s per item, one after the other
    assert [t for t, _ in store.commits()] == pytest.approx([0.5, 1.0])
    assert sorted(r[:2] for r in results) == [(True, a.tokens), (True, b.tokens)]
    assert q.counters.stored == 2 and q.pending == 0 and q.pending_bytes == 0
    assert a.released and b.released


async def test_pieces_wait_for_idle_and_never_overlap_a_busy_engine(autojump_clock):
    store = FakeStore()
    busy_until = 3.0
    q = SpillQueue(
        store,
        cap_bytes=10**6,
        idle=lambda: trio.current_time() >= busy_until,
        run_blocking=store.run_blocking,
        poll_s=0.05,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        ok = await q.submit(item(5))
        nursery.cancel_scope.cancel()
    assert ok
    pieces = [t for t, what, _ in store.log if what == "piece"]
    # begin (which writes the header) and every piece started after the engine idled: the first
    # piece's write ends 0.2 s after the idle edge (begin 0.1 + piece 0.1), within one poll.
    assert pieces and min(pieces) >= busy_until + 0.2 - 1e-9
    assert min(pieces) - (busy_until + 0.2) < 0.051


async def test_idle_gate_rechecks_before_every_piece(autojump_clock):
    store = FakeStore()
    # idle for the first piece's gate (t=0.1), a request arrives (busy 0.15 .. 2.0), idle again
    q = SpillQueue(
        store,
        cap_bytes=10**6,
        idle=lambda: not (0.15 <= trio.current_time() < 2.0),
        run_blocking=store.run_blocking,
        poll_s=0.05,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        await q.submit(item(5))
        nursery.cancel_scope.cancel()
    pieces = [t for t, what, _ in store.log if what == "piece"]
    # a piece is logged when its 0.1 s write ends: the second one's gate held it until t=2
    assert pieces[0] == pytest.approx(0.2) and pieces[1] >= 2.1 - 1e-9


async def test_forcing_writes_through_a_busy_engine(autojump_clock):
    store = FakeStore()
    q = SpillQueue(store, cap_bytes=10**6, idle=lambda: False, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        with q.forcing():
            assert await q.submit(item(5))
        assert trio.current_time() == pytest.approx(0.5)
        nursery.cancel_scope.cancel()


async def test_over_the_cap_the_oldest_queued_item_is_dropped(autojump_clock):
    store = FakeStore()
    q = SpillQueue(store, cap_bytes=250, idle=lambda: True, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        outcomes = {}

        async def submit(it):
            outcomes[it.tokens] = await q.submit(it)

        items = [item(n) for n in (1, 2, 3, 4)]
        nursery.start_soon(submit, items[0])
        await settle()  # items[0] is in flight now
        for it in items[1:]:
            nursery.start_soon(submit, it)
            await settle()
        # 400 bytes pending > 250: items[1] (oldest queued, not in flight, not newest) went first,
        # then items[2]; the in-flight one and the newest stay.
        assert q.counters.dropped == 2
        assert q.pending == 2 and q.pending_bytes == 200
        await q.drain()
        nursery.cancel_scope.cancel()
    assert outcomes == {(0,): True, (0, 1): False, (0, 1, 2): False, (0, 1, 2, 3): True}
    assert [toks for _, toks in store.commits()] == [(0,), (0, 1, 2, 3)]
    assert all(it.released for it in items)  # dropped clones are freed at once


async def test_cap_zero_keeps_only_the_newest_and_the_in_flight_item(autojump_clock):
    store = FakeStore()
    q = SpillQueue(store, cap_bytes=0, idle=lambda: True, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        for n in (1, 2, 3):
            q.submit_nowait(item(n))
            await settle()
        await q.drain()
        nursery.cancel_scope.cancel()
    assert [toks for _, toks in store.commits()] == [(0,), (0, 1, 2)]
    assert q.counters.dropped == 1


async def test_refused_and_failed_writes_count_as_failed(autojump_clock):
    store = FakeStore(max_bytes=150)
    store.fail_tokens.add((0, 1))
    q = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        assert not await q.submit(item(1, nbytes=500))  # refused: over the store's cap
        assert not await q.submit(item(2))  # commit returned False
        assert await q.submit(item(3))
        nursery.cancel_scope.cancel()
    assert (q.counters.failed, q.counters.stored) == (2, 1)


async def test_wait_for_sees_a_queued_spill(autojump_clock):
    store = FakeStore()
    q = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    async with trio.open_nursery() as nursery:
        await nursery.start(q.run)
        q.submit_nowait(item(7))
        assert await q.wait_for("", tuple(range(7))) is True
        assert await q.wait_for("", tuple(range(8))) is None
        nursery.cancel_scope.cancel()
