"""An abort reaches a running prefill on virtual time: the scheduler passes it to the worker at
once (`Worker.abort`), the fake's prefill ends there, the row closes and the queue moves on.

FakeWorker costs: open 0, prefill (a chunk of 4, or a whole group) 10 s, join 1 s, step 1 s.
"""

from __future__ import annotations

import trio

from actors.messages import Abort, StopRow
from tests.fakes import FakeWorker, scheduler_harness


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


def calls(worker: FakeWorker) -> list[tuple[float, str, object]]:
    return [(t, name, arg) for t, name, arg in worker.calls]


async def test_an_abort_mid_chunk_ends_the_prefill_and_the_next_row_opens_at_once(autojump_clock):
    worker = FakeWorker(prefill_cost=10.0)
    async with scheduler_harness(worker, capacity=1) as h:
        victim = h.submit(1, prompt(9), max_tokens=4)  # chunks 0-10, 10-20
        nxt = h.submit(2, prompt(3, salt=5), max_tokens=2)
        await trio.sleep(13)  # 3 s into the second chunk
        h.inbox.send_nowait(Abort(1))
        await trio.sleep(40)
    assert worker.aborts == {1: 13.0}
    assert calls(worker)[:5] == [
        (0.0, "open_row", 1),
        (0.0, "prefill", 1),
        (10.0, "prefill", 1),
        (13.0, "close_row", 1),  # the chunk ended with the abort, not at 20
        (13.0, "open_row", 2),
    ]
    assert worker.closed[1] == (13.0, False)
    assert victim.tokens == [] and victim.ended_at == 13.0
    assert nxt.tokens == worker.expected(prompt(3, salt=5), 2)
    assert h.scheduler.counters.aborted_rows == 1
    assert not worker.violations  # nothing but close_row after the abort


async def test_rows_that_never_reached_the_worker_send_it_no_abort(autojump_clock):
    worker = FakeWorker(prefill_cost=10.0, open_cost=2.0)
    async with scheduler_harness(worker, capacity=1) as h:
        h.submit(1, prompt(9), max_tokens=2)
        h.submit(2, prompt(9, salt=1), max_tokens=2)
        await trio.sleep(1)  # row 1's open_row is running; row 2 is queued
        h.inbox.send_nowait(Abort(1))
        h.inbox.send_nowait(Abort(2))
        await trio.sleep(30)
    assert worker.aborts == {}  # neither was open in the worker when aborted
    assert [name for _, name, _ in calls(worker)] == ["open_row", "close_row"]  # row 1 closed once open
    assert not worker.violations


async def test_a_stop_is_not_an_abort(autojump_clock):
    worker = FakeWorker(prefill_cost=10.0)
    async with scheduler_harness(worker) as h:
        h.submit(1, prompt(9), max_tokens=2)
        await trio.sleep(3)
        h.inbox.send_nowait(StopRow(1))
        await trio.sleep(30)
    assert worker.aborts == {}
    assert worker.closed[1] == (10.0, True)  # the chunk ran to its end; a stopped row is put
    assert not worker.violations


async def test_a_group_prefill_ends_early_only_once_all_its_rows_are_aborted(autojump_clock):
    worker = FakeWorker(prefill_cost=10.0, chunk=4)
    async with scheduler_harness(worker, group_prefill_tokens=16) as h:
        rows = [h.submit(i, prompt(4, salt=i), max_tokens=2) for i in (1, 2, 3)]
        await trio.sleep(3)
        h.inbox.send_nowait(Abort(1))  # one of three: the group call runs on for the others
        await trio.sleep(30)
        assert worker.closed[1][0] == 10.0
        assert rows[1].tokens == worker.expected(prompt(4, salt=2), 2)
        assert rows[2].tokens == worker.expected(prompt(4, salt=3), 2)

        again = [h.submit(i, prompt(4, salt=i), max_tokens=2) for i in (4, 5)]
        await trio.sleep(3)
        start = trio.current_time() - 3
        h.inbox.send_nowait(Abort(4))
        await trio.sleep(2)
        h.inbox.send_nowait(Abort(5))  # now every row of the group is aborted: the call ends
        await trio.sleep(30)
    group = [(t, arg) for t, name, arg in calls(worker) if name == "prefill_group"]
    assert group == [(0.0, (1, 2, 3)), (start, (4, 5))]
    assert worker.closed[4] == (start + 5, False) and worker.closed[5] == (start + 5, False)
    assert again[0].tokens == [] and again[1].tokens == []
    assert not worker.violations
