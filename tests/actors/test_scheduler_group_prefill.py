"""Group prefill on virtual time: simultaneous short arrivals are opened and prefilled in one
worker call, then join one by one in arrival order; capacity, the token budget, aborts and the
rows the worker could not group are all respected.

FakeWorker costs: open 0, prefill (a chunk, or a whole group) 1 s, join 1 s, step 1 s; chunk 4.
"""

from __future__ import annotations

import trio

from actors.messages import Abort
from tests.fakes import FakeWorker, scheduler_harness


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


def calls(worker: FakeWorker) -> list[tuple[str, object]]:
    return [(name, arg) for _, name, arg in worker.calls]


async def test_a_burst_is_prefilled_in_one_call_and_joins_in_order(autojump_clock):
    worker = FakeWorker(chunk=4)
    async with scheduler_harness(worker, group_prefill_tokens=16) as h:
        rows = [h.submit(i, prompt(4, salt=i), max_tokens=3) for i in (1, 2, 3)]
        await trio.sleep(20)
    assert calls(worker)[:6] == [
        ("open_row", 1),
        ("open_row", 2),
        ("open_row", 3),
        ("prefill_group", (1, 2, 3)),
        ("join_group", (1, 2, 3)),
        ("step", (1, 2, 3)),
    ]
    for i, row in zip((1, 2, 3), rows):
        assert row.tokens == worker.expected(prompt(4, salt=i), 3)
        assert row.token_times[0] == 3  # token 0 comes with the first step after the joint join
    assert h.scheduler.counters.group_prefills == 1
    assert not worker.violations


async def test_capacity_and_token_budget_bound_a_group(autojump_clock):
    worker = FakeWorker(chunk=8)
    async with scheduler_harness(worker, capacity=3, group_prefill_tokens=12) as h:
        # 6 tokens to prefill each: two fit the 12-token budget; capacity 3 admits one more later.
        rows = [h.submit(i, prompt(7, salt=i), max_tokens=2) for i in (1, 2, 3, 4)]
        await trio.sleep(40)
    groups = [arg for name, arg in calls(worker) if name == "prefill_group"]
    assert groups[0] == (1, 2)
    assert all(len(g) <= 2 for g in groups)
    running_peak = max(len(ids) for _, ids in worker.batches())
    assert running_peak <= 3
    for i, row in zip((1, 2, 3, 4), rows):
        assert row.tokens == worker.expected(prompt(7, salt=i), 2)
    assert not worker.violations


async def test_a_burst_wider_than_one_group_is_prefilled_in_groups_only(autojump_clock):
    # Three groups' worth of rows: none may be prefilled alone in between (on CUDA a solo row's
    # exact width costs a new attention graph while the running streams wait).
    worker = FakeWorker(chunk=8)
    async with scheduler_harness(worker, capacity=8, group_prefill_tokens=12) as h:
        rows = [h.submit(i, prompt(7, salt=i), max_tokens=2) for i in range(1, 7)]
        await trio.sleep(60)
    made = calls(worker)
    assert [arg for name, arg in made if name == "prefill_group"] == [(1, 2), (3, 4), (5, 6)]
    assert [arg for name, arg in made if name in ("prefill", "join")] == []
    # One group prefill between two steps: the running rows wait for one forward at a time.
    kinds = [name for name, _ in made if name in ("prefill_group", "step")]
    assert all(not (a == b == "prefill_group") for a, b in zip(kinds, kinds[1:]))
    for i, row in zip(range(1, 7), rows):
        assert row.tokens == worker.expected(prompt(7, salt=i), 2)
    assert not worker.violations


async def test_rows_left_staged_by_the_worker_are_never_dropped(autojump_clock):
    # The worker prefills only row 1 of the group (2 and 3 are longer than its chunk): 2 becomes
    # the joiner while 3 waits staged, and a later turn's group check must leave it there.
    worker = FakeWorker(chunk=4)
    async with scheduler_harness(worker, group_prefill_tokens=20) as h:
        specs = {
            1: prompt(4, salt=1),
            2: prompt(7, salt=2),
            3: prompt(7, salt=3),
            4: prompt(4, salt=4),
            5: prompt(4, salt=5),
        }
        rows = {i: h.submit(i, p, max_tokens=2) for i, p in specs.items()}
        await trio.sleep(80)
    assert ("prefill_group", (1, 2, 3)) in calls(worker)
    for i, p in specs.items():
        assert rows[i].tokens == worker.expected(p, 2), i
    assert h.scheduler.counters.finished_rows == 5
    assert not worker.violations


async def test_a_row_aborted_while_staged_never_joins(autojump_clock):
    worker = FakeWorker(chunk=4, prefill_cost=2.0)
    async with scheduler_harness(worker, group_prefill_tokens=16) as h:
        rows = {i: h.submit(i, prompt(4, salt=i), max_tokens=3) for i in (1, 2, 3)}
        await trio.sleep(1.0)  # mid group prefill: all three are staged
        h.inbox.send_nowait(Abort(3))
        await trio.sleep(30)
    assert ("join_group", (1, 2)) in calls(worker)
    assert not any(
        name.startswith("join") and 3 in (arg if isinstance(arg, tuple) else (arg,)) for name, arg in calls(worker)
    )
    assert 3 in worker.closed and worker.closed[3][1] is False  # closed, not reusable
    assert rows[3].tokens == []
    for i in (1, 2):
        assert rows[i].tokens == worker.expected(prompt(4, salt=i), 3)
    assert h.scheduler.counters.aborted_rows == 1
    assert not worker.violations


async def test_rows_too_long_to_group_prefill_alone(autojump_clock):
    worker = FakeWorker(chunk=4)
    async with scheduler_harness(worker, group_prefill_tokens=16) as h:
        short = [h.submit(i, prompt(4, salt=i), max_tokens=2) for i in (1, 2)]
        long_ = h.submit(3, prompt(13, salt=3), max_tokens=2)  # 12 to prefill: over one chunk
        await trio.sleep(40)
    assert ("prefill_group", (1, 2)) in calls(worker)
    assert [name for name, arg in calls(worker) if arg == 3].count("prefill") == 3  # alone, in chunks
    for i, row in zip((1, 2), short):
        assert row.tokens == worker.expected(prompt(4, salt=i), 2)
    assert long_.tokens == worker.expected(prompt(13, salt=3), 2)
    assert not worker.violations


async def test_off_by_default(autojump_clock):
    worker = FakeWorker(chunk=4)
    async with scheduler_harness(worker) as h:
        for i in (1, 2, 3):
            h.submit(i, prompt(4, salt=i), max_tokens=2)
        await trio.sleep(20)
    assert "prefill_group" not in [name for name, _ in calls(worker)]


async def test_a_row_aborted_while_joining_is_closed_before_any_step(autojump_clock):
    worker = FakeWorker(chunk=4, join_cost=2.0)
    async with scheduler_harness(worker, group_prefill_tokens=16) as h:
        rows = {i: h.submit(i, prompt(4, salt=i), max_tokens=3) for i in (1, 2, 3)}
        await trio.sleep(1.5)  # inside join_group (1 s to 3 s)
        h.inbox.send_nowait(Abort(2))
        await trio.sleep(30)
    assert worker.closed[2] == (3.0, False)  # at the join's boundary, before the first step
    assert all(2 not in ids for _, ids in worker.batches())
    assert rows[2].tokens == []
    for i in (1, 3):
        assert rows[i].tokens == worker.expected(prompt(4, salt=i), 3)
    assert not worker.violations
