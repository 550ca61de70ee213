"""The choices of one request (OpenAI's `n`) in the scheduler: the leader is held until its
siblings have arrived, prefills alone, forks its KV into them, and every choice then decodes as a
row of its own. MockClock with the fake worker, whose tokens depend only on (prompt, position)."""

from __future__ import annotations

import math

import attrs
import trio

from actors.admission import Admission
from actors.messages import Enqueue, GenerationRequest, Lane, Siblings
from actors.policy import AdmissionCeiling
from actors.row_table import Row, RowTable, rows_enqueued
from actors.scheduling import Fork, Settings, Stage, Turn, decide, group_at_head
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from tests.fakes import FakeWorker, RowLog, SchedulerHarness, scheduler_harness

PROMPT = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20)  # 9 tokens to prefill: 3 chunks of the fake's 4


def submit_choice(
    harness: SchedulerHarness,
    row_id: int,
    siblings: Siblings,
    *,
    prompt: tuple[int, ...] = PROMPT,
    max_tokens: int = 4,
    lane: Lane = "batched",
) -> RowLog:
    """One choice's Enqueue, as admission sends it; its channel is read into the returned log."""
    send, recv = trio.open_memory_channel(math.inf)
    spec = RowSpec(row_id, prompt, SamplingParams(seed=row_id), max_tokens)
    harness.inbox.send_nowait(Enqueue(spec=spec, lane=lane, rows=send, siblings=siblings))
    harness.receivers[row_id] = recv
    log = RowLog()
    harness._nursery.start_soon(harness._collect, recv, log)
    return log


def calls(worker: FakeWorker, name: str) -> list:
    return [arg for _, call, arg in worker.calls if call == name]


async def test_three_choices_prefill_once_and_each_decode_the_solo_output(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        logs = [submit_choice(harness, 10 + i, Siblings(key=7, index=i, count=3)) for i in range(3)]
        await trio.sleep(30)
    assert worker.violations == []
    assert calls(worker, "open_row") == [10]  # only the leader is opened ...
    assert calls(worker, "prefill") == [10, 10, 10]  # ... and prefilled: 9 tokens, 3 chunks, once
    assert calls(worker, "fork_rows") == [(10, 11, 12)]
    expected = worker.expected(PROMPT, 4)
    assert [log.tokens for log in logs] == [expected] * 3
    assert all(log.ended_at is not None for log in logs)
    assert set(worker.closed) == {10, 11, 12}
    assert harness.scheduler.counters.forked_rows == 2
    assert harness.scheduler.table.families == {}


async def test_the_leader_waits_for_its_siblings_before_it_opens(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        lead = submit_choice(harness, 1, Siblings(key=3, index=0, count=2))
        await trio.sleep(5)
        assert calls(worker, "open_row") == []  # held: choice 1 is on its way
        follower = submit_choice(harness, 2, Siblings(key=3, index=1, count=2))
        await trio.sleep(30)
    assert calls(worker, "open_row") == [1] and calls(worker, "fork_rows") == [(1, 2)]
    assert lead.tokens == follower.tokens == worker.expected(PROMPT, 4)


async def test_a_family_waits_for_room_for_all_its_rows(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=3) as harness:
        other = harness.submit(1, (5, 6), max_tokens=6)
        await trio.sleep(2.5)  # row 1 is decoding: 2 slots left, the family needs 3
        logs = [submit_choice(harness, 10 + i, Siblings(key=1, index=i, count=3)) for i in range(3)]
        await trio.sleep(40)
    assert worker.violations == []
    assert max(len(ids) for _, ids in worker.batches()) == 3
    opened = next(t for t, call, arg in worker.calls if call == "open_row" and arg == 10)
    assert opened >= other.ended_at - 1  # not before row 1 was about to leave
    assert [log.tokens for log in logs] == [worker.expected(PROMPT, 4)] * 3


async def test_choices_next_to_other_rows_equal_their_solo_outputs(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=8) as harness:
        before = harness.submit(1, (7, 8, 9), max_tokens=12)
        logs = [submit_choice(harness, 10 + i, Siblings(key=2, index=i, count=3), max_tokens=6) for i in range(3)]
        after = harness.submit(2, (3, 1, 4, 1, 5), max_tokens=8)
        await trio.sleep(60)
    assert worker.violations == []
    assert before.tokens == worker.expected((7, 8, 9), 12)
    assert after.tokens == worker.expected((3, 1, 4, 1, 5), 8)
    assert [log.tokens for log in logs] == [worker.expected(PROMPT, 6)] * 3
    assert max(len(ids) for _, ids in worker.batches()) == 5  # they decoded together


async def test_a_leader_that_leaves_before_forking_hands_its_place_to_its_siblings(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        blocker = harness.submit(1, (9, 9, 9, 9, 9, 9, 9, 9, 9), max_tokens=2, lane="serial")
        await trio.sleep(0.5)
        logs = [submit_choice(harness, 10 + i, Siblings(key=4, index=i, count=3)) for i in range(3)]
        await trio.sleep(1)
        harness.scheduler.apply(_abort(10))  # the leader goes while queued
        await trio.sleep(60)
    assert worker.violations == []
    assert blocker.tokens == worker.expected((9,) * 9, 2)
    assert logs[0].tokens == [] and logs[0].ended_at is not None
    assert [log.tokens for log in logs[1:]] == [worker.expected(PROMPT, 4)] * 2  # each prefilled alone
    assert sorted(calls(worker, "open_row")) == [1, 11, 12]
    assert calls(worker, "fork_rows") == []


async def test_a_choice_aborted_before_the_fork_frees_its_slot_and_the_rest_go_on(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        logs = [submit_choice(harness, 10 + i, Siblings(key=5, index=i, count=3)) for i in range(3)]
        await trio.sleep(1.5)  # the leader is prefilling, its siblings wait for the fork
        harness.scheduler.apply(_abort(11))
        await trio.sleep(30)
    assert worker.violations == []
    assert calls(worker, "fork_rows") == [(10, 12)]
    assert logs[1].tokens == [] and logs[1].ended_at is not None
    assert logs[0].tokens == logs[2].tokens == worker.expected(PROMPT, 4)
    assert harness.scheduler.counters.aborted_rows == 1


async def test_aborting_every_choice_mid_decode_closes_every_row(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        for i in range(3):
            submit_choice(harness, 10 + i, Siblings(key=6, index=i, count=3), max_tokens=50)
        await trio.sleep(8)
        assert len(worker.batches()[-1][1]) == 3
        for i in range(3):  # a client disconnect closes every choice's actor
            harness.scheduler.apply(_abort(10 + i))
        await trio.sleep(3)
        assert worker.rows == {} and set(worker.closed) == {10, 11, 12}
        assert all(reusable is False for _, reusable in worker.closed.values())


async def test_serial_choices_run_together_and_alone(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as harness:
        logs = [
            submit_choice(harness, 10 + i, Siblings(key=8, index=i, count=2), lane="serial", max_tokens=5)
            for i in range(2)
        ]
        later = harness.submit(1, (4, 4), max_tokens=2)
        await trio.sleep(40)
    assert [log.tokens for log in logs] == [worker.expected(PROMPT, 5)] * 2
    assert later.tokens == worker.expected((4, 4), 2)
    widths = [ids for _, ids in worker.batches()]
    assert all(set(ids) <= {10, 11} or set(ids) == {1} for ids in widths)  # nothing joined the family


# -- the pure parts: the row table, the decision, admission


def _abort(row_id: int):
    from actors.messages import Abort

    return Abort(row_id)


def _row(row_id: int, prompt: tuple[int, ...] = PROMPT) -> Row:
    send, _ = trio.open_memory_channel(0)
    return Row(spec=RowSpec(row_id, prompt, SamplingParams(), 4), lane="batched", out=send)


def test_a_prefilled_leader_forks_before_it_joins_and_never_opens_a_group():
    table = RowTable(8)
    for i in range(3):
        table.enqueue_sibling(_row(10 + i), Siblings(key=1, index=i, count=3))
    table.enqueue(_row(20, (1, 2)))
    assert [r.row_id for r in table.queue] == [10, 20] and len(table.families[1].followers) == 2
    assert group_at_head(table, 4096) == []  # the leader prefills alone
    head = table.admissible_head()
    assert head is not None and head.row_id == 10
    table.admit(head)
    head.opened, head.to_prefill = True, 0
    action = decide(table, 0.0, 0, Settings(group_prefill_tokens=4096), Turn(stage=Stage.JOINER))
    assert action == Fork(head)
    assert [r.row_id for r in table.fork(head)] == [11, 12]
    assert [r.row_id for r in table.staged] == [11, 12] and table.families == {}


def test_a_sibling_whose_leader_is_gone_is_queued_alone():
    table = RowTable(8)
    table.enqueue_sibling(_row(1), Siblings(key=9, index=0, count=3))
    assert table.admissible_head() is None  # its siblings are on their way
    table.enqueue_sibling(_row(2), Siblings(key=9, index=1, count=3))
    dropped = table.mark_leaving(1, "abort")
    assert dropped is not None and dropped.row_id == 1
    assert [r.row_id for r in table.queue] == [2] and table.families == {}  # it took the leader's place
    table.enqueue_sibling(_row(3), Siblings(key=9, index=2, count=3))  # too late to share anything
    assert [r.row_id for r in table.queue] == [2, 3]
    assert table.admissible_head() is table.queue[0]


def test_a_leader_counts_its_whole_family_before_its_siblings_arrive():
    # Admission counts a request's n rows at its first choice (`rows_enqueued`); the table
    # counts them from the leader's arrival, so the pending rows never dip between choices.
    assert [rows_enqueued(Siblings(key=1, index=i, count=3)) for i in range(3)] == [3, 0, 0]
    assert rows_enqueued(None) == 1 and rows_enqueued(Siblings(key=1, index=0, count=1)) == 1
    table = RowTable(4)
    table.enqueue_sibling(_row(1), Siblings(key=9, index=0, count=3))
    assert table.queued_rows == 3
    table.enqueue_sibling(_row(2), Siblings(key=9, index=1, count=3))
    assert table.queued_rows == 3
    assert table.mark_leaving(2, "abort") is not None  # a choice that leaves is no longer counted
    assert table.queued_rows == 2
    table.enqueue_sibling(_row(3), Siblings(key=9, index=2, count=3))
    head = table.admissible_head()
    assert head is not None and head.row_id == 1 and table.queued_rows == 2
    table.admit(head)
    assert table.queued_rows == 0 and table.active_rows == 2


def _admission(max_safe_context: int, max_queue: int = 8, free: int = 0) -> tuple[Admission, list]:
    """Admission in front of `free` idle batch slots; its queue cap reads the rows it admitted."""
    sent: list = []

    class Inbox:
        def send_nowait(self, message):
            sent.append(message)

    ceiling = AdmissionCeiling(
        memory_budget_bytes=0, usable_bytes=0, weights_bytes=0, transient_bytes=0, max_safe_context=max_safe_context
    )
    admission = Admission(
        ceiling=ceiling,
        mode="batch",
        max_queue=max_queue,
        waiting=lambda: max(0, admission.enqueued - free),
        scheduler=Inbox(),
    )
    return admission, sent


def test_admission_fits_every_choice_in_the_safe_context():
    admission, _ = _admission(max_safe_context=300)
    request = GenerationRequest(prompt=(1,) * 50, sampling=SamplingParams(), max_tokens=1000)
    alone = admission.decide(request)
    three = admission.decide(attrs.evolve(request, siblings=Siblings(1, 0, 3)))
    assert alone.max_tokens == 250 and three.max_tokens == 50  # 3 x (50 + 50) = 300
    refused = admission.decide(attrs.evolve(request, prompt=(1,) * 120, siblings=Siblings(2, 0, 3)))
    assert refused.status == 400 and "3 choices" in refused.message


def test_only_a_requests_first_choice_meets_the_queue_cap():
    # One free slot, --max-queue 1: a request of n=2 fits (one row starts, one waits) and is
    # counted whole at its first choice; the next one would leave 3 waiting.
    admission, _ = _admission(max_safe_context=4096, max_queue=1, free=1)
    request = GenerationRequest(prompt=(1, 2), sampling=SamplingParams(), max_tokens=4)
    assert admission.decide(attrs.evolve(request, siblings=Siblings(1, 0, 2))).max_tokens == 4
    assert admission.enqueued == 2
    assert admission.decide(attrs.evolve(request, siblings=Siblings(2, 0, 2))).status == 503
    # the first request's second choice was counted already: it is neither checked nor counted again
    assert admission.decide(attrs.evolve(request, siblings=Siblings(1, 1, 2))).max_tokens == 4
    assert admission.enqueued == 2
