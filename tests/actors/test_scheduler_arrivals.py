"""The arrival hold on virtual time: a queue head that could share a group prefill waits (up to
the arrival window) for requests still on their way in — read, parsed, templated — and then
prefills with them in one forward; with nothing on its way it never waits.

FakeWorker costs: open 0, prefill (a chunk, or a whole group) 1 s, join 1 s, step 1 s; chunk 4.
"""

from __future__ import annotations

import trio

from actors.arrivals import Arrivals
from tests.fakes import FakeWorker, scheduler_harness

WINDOW = 0.5


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


def opened_at(worker: FakeWorker, row_id: int) -> float:
    return next(t for t, name, arg in worker.calls if name == "open_row" and arg == row_id)


def made(worker: FakeWorker, *names: str) -> list[tuple[str, object]]:
    return [(name, arg) for _, name, arg in worker.calls if name in names]


async def arrive(h, arrivals: Arrivals, row_id: int, after: float, *, reaches_queue: bool = True, n: int = 4):
    """One request on its way in for `after` seconds: enqueued then, or (a 400) never."""
    with arrivals.arriving():
        await trio.sleep(after)
        if reaches_queue:
            h.submit(row_id, prompt(n, salt=row_id), max_tokens=2)
            await trio.sleep(0)  # admission's answer comes one hop after the Enqueue


async def test_a_lone_head_waits_for_a_request_still_arriving(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive, h, arrivals, 2, 0.2)
            await trio.sleep(0)
            first = h.submit(1, prompt(4, salt=1), max_tokens=2)
        await trio.sleep(10)
    assert made(worker, "prefill_group", "prefill") == [("prefill_group", (1, 2))]
    assert opened_at(worker, 1) == opened_at(worker, 2) == 0.2  # the moment row 2 arrived
    assert first.tokens == worker.expected(prompt(4, salt=1), 2)
    assert arrivals.pending == 0
    assert not worker.violations


async def test_the_hold_never_outlasts_the_window(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive, h, arrivals, 2, 3.0)  # a slow upload: row 1 goes alone
            await trio.sleep(0)
            first = h.submit(1, prompt(4, salt=1), max_tokens=2)
        await trio.sleep(10)
    assert opened_at(worker, 1) == WINDOW
    assert ("prefill", 1) in made(worker, "prefill")
    assert first.tokens == worker.expected(prompt(4, salt=1), 2)
    assert not worker.violations


async def test_an_arrival_that_never_reaches_the_queue_ends_the_hold_at_once(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: arrive(h, arrivals, 2, 0.1, reaches_queue=False))
            await trio.sleep(0)
            h.submit(1, prompt(4, salt=1), max_tokens=2)
        await trio.sleep(10)
    assert opened_at(worker, 1) == 0.1
    assert arrivals.pending == 0


async def test_nothing_on_its_way_no_wait(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        h.submit(1, prompt(4, salt=1), max_tokens=2)
        await trio.sleep(10)
    assert opened_at(worker, 1) == 0


async def test_a_head_too_wide_to_share_a_group_does_not_wait(autojump_clock):
    worker, arrivals = FakeWorker(chunk=16), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive, h, arrivals, 2, 0.2)
            await trio.sleep(0)
            h.submit(1, prompt(10, salt=1), max_tokens=2)  # 9 tokens: two such rows exceed 16
        await trio.sleep(10)
    assert opened_at(worker, 1) == 0


async def test_a_group_with_room_waits_for_the_rest_of_its_burst(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=WINDOW) as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive, h, arrivals, 3, 0.3)
            await trio.sleep(0)
            h.submit(1, prompt(4, salt=1), max_tokens=2)
            h.submit(2, prompt(4, salt=2), max_tokens=2)
        await trio.sleep(10)
    assert made(worker, "prefill_group", "prefill") == [("prefill_group", (1, 2, 3))]
    assert not worker.violations


async def test_running_streams_keep_stepping_while_the_head_is_held(autojump_clock):
    worker, arrivals = FakeWorker(chunk=4), Arrivals()
    async with scheduler_harness(worker, group_prefill_tokens=16, arrivals=arrivals, arrival_window=5.0) as h:
        h.submit(1, prompt(4, salt=1), max_tokens=20)
        await trio.sleep(3)  # row 1 decodes
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arrive, h, arrivals, 3, 2.5)
            await trio.sleep(0)
            h.submit(2, prompt(4, salt=2), max_tokens=2)
        await trio.sleep(30)
    held_from, group_at = 3, opened_at(worker, 2)
    assert group_at >= held_from + 2.5
    steps_meanwhile = [t for t, ids in worker.batches() if held_from <= t < group_at]
    assert len(steps_meanwhile) >= 2 and all(ids == (1,) for t, ids in worker.batches() if t in steps_meanwhile)
    assert ("prefill_group", (2, 3)) in made(worker, "prefill_group")
    assert not worker.violations


async def test_no_hold_without_group_prefill_or_window(autojump_clock):
    for group_tokens, window in ((0, WINDOW), (16, 0.0)):
        worker, arrivals, start = FakeWorker(chunk=4), Arrivals(), trio.current_time()
        async with scheduler_harness(
            worker, group_prefill_tokens=group_tokens, arrivals=arrivals, arrival_window=window
        ) as h:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive, h, arrivals, 2, 0.2)
                await trio.sleep(0)
                h.submit(1, prompt(4, salt=1), max_tokens=2)
            await trio.sleep(10)
        assert opened_at(worker, 1) == start
