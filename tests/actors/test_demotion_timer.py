"""The demotion-timer actor on virtual time: cadence, busy skips, spills of what the SSD lacks."""

from __future__ import annotations

import trio

from actors.ssd.demotion_timer import DemotionTimer, demotion_interval
from actors.ssd.spill_queue import SpillQueue
from tests.helpers.ssd_fakes import FakePort, FakeStore

A = tuple(range(10, 20))
B = tuple(range(30, 40))


def test_interval_is_a_quarter_of_the_threshold_but_at_least_30_s():
    assert demotion_interval(300) == 75
    assert demotion_interval(60) == 30
    assert demotion_interval(1000) == 250


async def run_timer(port, spills, *, busy, idle_s, until):
    timer = DemotionTimer(port, spills, busy=busy, idle_s=idle_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(spills.run)
        await nursery.start(timer.run)
        await trio.sleep_until(until)
        nursery.cancel_scope.cancel()
    return timer


async def test_ticks_on_a_fixed_cadence_and_demotes_idle_entries(autojump_clock):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    port.put(A)  # last used at t=0
    timer = await run_timer(port, spills, busy=lambda: False, idle_s=120, until=200)
    # interval 30 s: ticks at 30, 60, ... 180; A is idle >= 120 s at the t=120 tick
    assert port.demote_calls == [30, 60, 90, 120, 150, 180]
    assert timer.counters.ticks == 6 and timer.counters.spilled == 1
    assert port.ram == {} and port.demotions == 1
    assert [t for _, t in store.commits()] == [A]


async def test_ticks_are_skipped_while_rows_are_active_or_pending(autojump_clock):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    port.put(A)
    timer = await run_timer(port, spills, busy=lambda: 50 <= trio.current_time() < 130, idle_s=40, until=200)
    assert port.demote_calls == [30, 150, 180]  # the ticks at 60, 90 and 120 were skipped
    assert timer.counters.skipped_busy == 3
    assert [t for _, t in store.commits()] == [A]  # demoted at the first idle tick after 40 s


async def test_entries_already_on_disk_are_freed_without_a_write(autojump_clock):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    port.put(A)
    store.files[("", A)] = 100
    timer = await run_timer(port, spills, busy=lambda: False, idle_s=30, until=100)
    assert port.ram == {} and port.demotions == 1 and timer.counters.spilled == 0
    assert store.commits() == []


async def test_recently_used_entries_stay(autojump_clock):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)

    async def keep_using_b():
        while True:
            await trio.sleep(20)
            port.last_used[("", B)] = trio.current_time()

    port.put(A)
    port.put(B)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_using_b)
        await run_timer(port, spills, busy=lambda: False, idle_s=60, until=200)
        nursery.cancel_scope.cancel()
    assert list(port.ram) == [("", B)]


async def test_zero_threshold_means_off(autojump_clock):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    port.put(A)
    await run_timer(port, spills, busy=lambda: False, idle_s=0, until=1000)
    assert port.demote_calls == [] and ("", A) in port.ram
