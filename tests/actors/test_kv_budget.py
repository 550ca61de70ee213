"""The live-KV budget in the scheduler (MockClock, fake worker): rows open only while every active
row's KV and the newcomer's next growth fit; a decode step whose growth would not fit preempts the
running row that arrived last, which resumes ahead of later arrivals with exactly its tokens."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from actors.kv_memory import GROWTH_TOKENS, KvBudget
from actors.messages import Abort
from actors.policy import KvRate
from model.engine.rows import RowOpened
from tests.fakes import FakeWorker, scheduler_harness


def budget(tokens: int) -> KvBudget:
    """A budget of `tokens` positions (one byte each)."""
    return KvBudget(tokens, KvRate(bytes_per_token=1))


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


def opens(worker: FakeWorker, row_id: int) -> list[float]:
    return [t for t, call, arg in worker.calls if call == "open_row" and arg == row_id]


async def test_a_row_without_room_waits_until_a_row_ends(autojump_clock):
    async def run(kv: KvBudget | None) -> tuple[FakeWorker, float, float]:
        worker = FakeWorker(chunk=512)
        async with scheduler_harness(worker, kv_budget=kv) as h:
            first = h.submit(1, prompt(300), max_tokens=10)
            await trio.sleep(0.5)
            second = h.submit(2, prompt(300, salt=1), max_tokens=10)
            await trio.sleep(60)
        assert first.tokens == worker.expected(prompt(300), 10)
        assert second.tokens == worker.expected(prompt(300, salt=1), 10)
        assert not worker.violations
        assert first.ended_at is not None
        return worker, opens(worker, 2)[0], worker.closed[1][0]

    # Two rows of 300 positions and their next growth need 2 x 768 > 1024: the second waits.
    worker, second_opened, first_closed = await run(budget(1024))
    assert second_opened >= first_closed
    # With room for both (no budget), it opens beside the first.
    worker, second_opened, first_closed = await run(None)
    assert second_opened < first_closed


async def test_a_preempted_row_resumes_before_later_arrivals(autojump_clock):
    worker = FakeWorker(chunk=512)
    async with scheduler_harness(worker, kv_budget=budget(1024)) as h:
        # Both open (2 x 512 fits) and grow; past 512 positions the pair needs 2 x 768.
        first = h.submit(1, prompt(200), max_tokens=400)
        second = h.submit(2, prompt(200, salt=1), max_tokens=400)
        await trio.sleep(50)
        later = h.submit(3, prompt(100, salt=2), max_tokens=5)  # no room: it waits at the head
        await trio.sleep(2000)
        counters = h.scheduler.counters
    assert (counters.preemptions, counters.resumes) == (1, 1)
    # The victim is the later arrival of the two; its reopening comes before the later request's.
    assert len(opens(worker, 1)) == 1 and len(opens(worker, 2)) == 2
    assert opens(worker, 2)[1] < opens(worker, 3)[0]
    resumed = worker.specs[2]
    assert resumed.resumed > 0 and resumed.prompt[:200] == prompt(200, salt=1)
    # Every stream has exactly its solo tokens: nothing lost, nothing sent twice, one RowOpened.
    assert first.tokens == worker.expected(prompt(200), 400)
    assert second.tokens == worker.expected(prompt(200, salt=1), 400)
    assert later.tokens == worker.expected(prompt(100, salt=2), 5)
    assert sum(isinstance(e, RowOpened) for _, e in second.events) == 1
    # The paused stream got no token between its preemption and its resumption.
    gap = max(b - a for a, b in zip(second.token_times, second.token_times[1:]))
    assert gap > 50  # (the first row decodes its last ~88 tokens meanwhile)
    # Peak live KV stayed within the budget (as the scheduler bills it).
    assert 0 < counters.peak_kv_bytes <= 1024
    assert not worker.violations and not worker.rows


async def test_cancelling_a_preempted_row_frees_everything(autojump_clock):
    worker = FakeWorker(chunk=512)
    async with scheduler_harness(worker, kv_budget=budget(1024)) as h:
        first = h.submit(1, prompt(200), max_tokens=400)
        second = h.submit(2, prompt(200, salt=1), max_tokens=400)
        await trio.sleep(50)
        later = h.submit(3, prompt(100, salt=2), max_tokens=5)
        while h.scheduler.counters.preemptions == 0:
            await trio.sleep(1)
        h.inbox.send_nowait(Abort(2))
        await trio.sleep(1)
        delivered = len(second.tokens)
        # Gone at once: out of the table, its stream closed, nothing held for it by the worker.
        assert second.ended_at is not None
        assert all(row.row_id != 2 for row in h.scheduler.table.rows())
        assert 2 not in worker.rows
        await trio.sleep(2000)
        counters = h.scheduler.counters
    assert len(second.tokens) == delivered  # nothing after the abort
    assert second.tokens == worker.expected(prompt(200, salt=1), 400)[:delivered]
    assert (counters.preemptions, counters.resumes, counters.aborted_rows) == (1, 0, 1)
    assert len(opens(worker, 2)) == 1
    assert first.tokens == worker.expected(prompt(200), 400)
    assert later.tokens == worker.expected(prompt(100, salt=2), 5)
    assert not worker.violations and not worker.rows


async def test_rows_that_cannot_come_back_exactly_are_never_preempted(autojump_clock):
    worker = FakeWorker(chunk=512)
    async with scheduler_harness(worker, kv_budget=budget(1024), preempts=False) as h:
        first = h.submit(1, prompt(200), max_tokens=400)
        second = h.submit(2, prompt(200, salt=1), max_tokens=400)
        await trio.sleep(2000)
        counters = h.scheduler.counters
    assert counters.preemptions == 0
    assert first.tokens == worker.expected(prompt(200), 400)
    assert second.tokens == worker.expected(prompt(200, salt=1), 400)
    assert not worker.violations


def test_growth_is_billed_in_whole_buffer_steps_padded_to_the_longest_row():
    kv = KvBudget(10**9, KvRate(bytes_per_token=2, state_bytes_per_row=5))
    assert kv.row_bytes(1) == 2 * GROWTH_TOKENS + 5
    assert kv.row_bytes(GROWTH_TOKENS + 1) == 2 * 2 * GROWTH_TOKENS + 5
    assert kv.batch_bytes(3, GROWTH_TOKENS) == 3 * (2 * GROWTH_TOKENS + 5)


async def test_choices_that_do_not_fit_together_fork_only_what_fits_the_rest_wait(autojump_clock):
    """A request's choices (n) share the leader's prefill, but its fork opens only the siblings
    whose KV fits beside the active rows: the others wait in the queue and run as rows end, so the
    live KV never passes the budget, and every choice still gives its solo output."""
    from actors.messages import Enqueue, Siblings
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec
    from tests.fakes import RowLog

    worker = FakeWorker(chunk=512)
    async with scheduler_harness(worker, kv_budget=budget(600)) as h:
        logs = []
        for i in range(3):  # each row bills 512 positions (200 + its next growth): one fits at a time
            send, recv = trio.open_memory_channel(100)
            spec = RowSpec(10 + i, prompt(200), SamplingParams(seed=0), 20)
            h.inbox.send_nowait(Enqueue(spec=spec, lane="batched", rows=send, siblings=Siblings(7, i, 3)))
            logs.append(RowLog())
            h._nursery.start_soon(h._collect, recv, logs[-1])
        await trio.sleep(600)
    assert not worker.violations
    assert [log.tokens for log in logs] == [worker.expected(prompt(200), 20)] * 3
    assert all(log.ended_at is not None for log in logs)
    assert h.scheduler.counters.preemptions == 0  # (forked over the budget, two had to be preempted)
    open_rows, most = 0, 0
    for _, call, _ in worker.calls:
        open_rows += {"open_row": 1, "fork_rows": 2, "close_row": -1}.get(call, 0)
        most = max(most, open_rows)
    assert most == 1


def test_an_explicit_kv_budget_admits_a_lone_row_in_whole_growth_steps():
    """A lone row opens and grows with nothing to preempt, so admission's clamp is all that bounds
    it: under `--kv-budget` a row may grow only to what its KV buffers, grown a whole step at a
    time, still fit (the step about to be allocated included), so it never passes the budget."""
    from actors.policy import admission_ceiling, fit_rows

    def ceiling(kv_budget_bytes: int | None, state: int = 0):
        return admission_ceiling(
            budget_bytes=10**9,
            weights_bytes=0,
            kv_bytes_per_token=1,
            context_length=10**6,
            transient_bytes=0,
            state_bytes_per_row=state,
            kv_budget_bytes=kv_budget_bytes,
        )

    kv = budget(1000)
    limited = ceiling(1000)
    assert limited.max_safe_context == limited.memory_context(1) == 3 * GROWTH_TOKENS
    assert kv.row_bytes(limited.memory_context(1)) <= 1000 < kv.row_bytes(limited.memory_context(1) + 1)
    # A prompt of 4 asking for far more: clamped to what its whole steps hold (not 996 tokens).
    assert fit_rows(limited, prompt_tokens=4, max_tokens=5000) == 3 * GROWTH_TOKENS - 4
    # A request's n rows together, each with its fixed state.
    assert ceiling(1000).memory_context(2) == GROWTH_TOKENS
    stateful = KvBudget(1000, KvRate(bytes_per_token=1, state_bytes_per_row=300))
    assert ceiling(1000, state=300).memory_context(1) == 2 * GROWTH_TOKENS
    assert stateful.row_bytes(2 * GROWTH_TOKENS) <= 1000
    # Under the memory budget alone, a row is billed by its tokens as before.
    assert ceiling(None).memory_context(1) == 10**9


class BillingWorker(FakeWorker):
    """A fake worker that records the scheduler's live-KV bill as each of its calls starts."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.bill = lambda: 0
        self.bills: list[tuple[str, int]] = []

    @asynccontextmanager
    async def _call(self, name, arg, cost, stoppable=()):
        self.bills.append((name, self.bill()))
        async with super()._call(name, arg, cost, stoppable):
            yield


async def test_a_request_of_n_choices_bills_the_rows_it_opened_when_it_opened_them(autojump_clock):
    """The leader of `n` choices holds one row of KV until it forks the others (and only those that
    fit open then): the live bill, and so /stats' peak, counts the rows the worker holds, not the
    family the leader will fork."""
    from actors.messages import Enqueue, Siblings
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec

    async def run(kv: KvBudget) -> BillingWorker:
        worker = BillingWorker(chunk=512)
        async with scheduler_harness(worker, kv_budget=kv) as h:
            worker.bill = h.scheduler.table.kv_bytes
            readers = []  # (kept open: a row whose reader is gone is aborted)
            for i in range(3):
                send, recv = trio.open_memory_channel(100)
                readers.append(recv)
                spec = RowSpec(10 + i, prompt(200), SamplingParams(seed=0), 20)
                h.inbox.send_nowait(Enqueue(spec=spec, lane="batched", rows=send, siblings=Siblings(7, i, 3)))
            await trio.sleep(600)
            worker.peak = h.scheduler.counters.peak_kv_bytes
        assert not worker.violations and not worker.rows
        return worker

    one_row = budget(10**6).row_bytes(200 + 19)  # (a row never passes its first growth step here)
    # Room for all three: the leader prefills as one row; the three rows decode together after the fork.
    worker = await run(budget(10**6))
    assert [bill for call, bill in worker.bills if call == "prefill"] == [one_row]
    steps = [(bill, len(ids)) for (_, bill), (_, call, ids) in zip(worker.bills, worker.calls) if call == "step"]
    assert all(bill == rows * one_row for bill, rows in steps) and max(rows for _, rows in steps) == 3
    assert worker.peak == 3 * one_row
    # Room for one row at a time: each choice runs alone, and the peak is one row's, within the budget.
    worker = await run(budget(600))
    assert max(bill for _, bill in worker.bills) == one_row
    assert worker.peak == one_row <= 600


def test_the_billing_step_is_the_kv_buffers_growth_step():
    """actors/policy.py restates the step (it imports nothing of MLX): the bill must stay the
    buffers' step and the paged pool's block."""
    from model.kv.cache import STEP
    from model.kv.paged import BLOCK

    assert GROWTH_TOKENS == STEP == BLOCK
