"""Admission: the memory ceiling and clamp, the queue bound, placement and seeds."""

from __future__ import annotations

import logging
import math

import trio
import trio.testing

from actors.admission import Admission
from actors.messages import Abort, Admitted, Enqueue, GenerationRequest, Rejected, Siblings, Submit
from actors.options import options as serve_options
from actors.policy import (
    SeedSource,
    admission_ceiling,
    batch_mode,
    fit_rows,
    memory_budget_bytes,
    place,
    waiting_rows,
)
from actors.request import RequestActor, RequestRejected
from actors.root import start_actors
from model.engine.params import SamplingParams
from model.options import ServerOptions
from tests.fakes import FakeTokenizer, FakeWorker

# One prefill forward's transient, as the model would report it (model/engine/prefill_memory.py).
TRANSIENT = 2048 * 550_000


def make_admission(*, max_safe=1000, waiting=0, max_queue=4, mode="batch"):
    sent, received = trio.open_memory_channel(math.inf)
    ceiling = admission_ceiling(
        transient_bytes=TRANSIENT,
        budget_bytes=TRANSIENT + max_safe,
        weights_bytes=0,
        kv_bytes_per_token=1,
        context_length=10**9,
    )
    admission = Admission(
        ceiling=ceiling,
        mode=mode,
        max_queue=max_queue,
        waiting=lambda: waiting,
        scheduler=sent,
        seeds=SeedSource(clock_ms=lambda: 1234),
    )
    return admission, received


def request(n=10, max_tokens=100, **kw):
    return GenerationRequest(prompt=tuple(range(1, n + 1)), sampling=SamplingParams(), max_tokens=max_tokens, **kw)


def test_ceiling_subtracts_weights_and_prefill_transient_and_caps_at_positions():
    c = admission_ceiling(
        transient_bytes=TRANSIENT,
        budget_bytes=10_000_000_000,
        weights_bytes=2_000_000_000,
        kv_bytes_per_token=100_000,
        context_length=10**9,
    )
    assert c.usable_bytes == 8_000_000_000 - 2048 * 550_000
    assert c.max_safe_context == c.usable_bytes // 100_000
    assert (
        admission_ceiling(
            transient_bytes=TRANSIENT, budget_bytes=10**12, weights_bytes=0, kv_bytes_per_token=1, context_length=4096
        ).max_safe_context
        == 4096
    )
    assert (
        admission_ceiling(
            transient_bytes=TRANSIENT, budget_bytes=1, weights_bytes=10**9, kv_bytes_per_token=1, context_length=4096
        ).max_safe_context
        == 0
    )


def test_budget_is_decimal_gb_or_three_quarters_of_memory():
    assert memory_budget_bytes(1.5) == 1_500_000_000
    assert memory_budget_bytes(None, device_memory_bytes=8_000_000_000) == 6_000_000_000
    assert memory_budget_bytes(None) > 0  # system RAM


def test_only_the_rows_beyond_the_free_slots_wait():
    assert waiting_rows(pending=10, active=0, capacity=32, mode="batch") == 0
    assert waiting_rows(pending=40, active=0, capacity=32, mode="batch") == 8
    assert waiting_rows(pending=3, active=30, capacity=32, mode="batch") == 1
    assert waiting_rows(pending=2, active=40, capacity=32, mode="batch") == 2  # never below the pending
    # a serial server runs one row at a time, whatever --batch says
    assert waiting_rows(pending=10, active=0, capacity=32, mode="serial") == 9
    assert waiting_rows(pending=10, active=1, capacity=1, mode="off") == 10


def test_placement_is_the_servers_mode_only():
    assert place(mode="batch") == "batched"
    assert place(mode="off") == "serial"
    assert place(mode="serial") == "serial"
    assert batch_mode(1, batchable=True) == "off"
    assert batch_mode(8, batchable=False) == "serial"


def test_default_seeds_are_unique_within_one_millisecond():
    seeds = SeedSource(clock_ms=lambda: 1_700_000_000_000)
    drawn = [seeds.next() for _ in range(100_000)]
    assert len(set(drawn)) == len(drawn)
    assert all(0 <= s < 2**32 for s in drawn)


async def test_decisions():
    admission, _ = make_admission(max_safe=50)
    ok = admission.decide(request(10, 100))
    assert isinstance(ok, Admitted) and ok.max_tokens == 40 and ok.lane == "batched"
    over = admission.decide(request(50, 1))
    assert isinstance(over, Rejected) and (over.status, over.type, over.code) == (
        400,
        "memory_admission",
        "context_over_budget",
    )
    assert over.message == (
        "prompt is 50 tokens but the memory budget caps safe context at 50 — no room "
        "to generate; shorten the prompt or raise --memory-budget"
    )
    seeded = admission.decide(request(seed=7))
    assert seeded.lane == "batched" and seeded.seed == 7  # a seeded row stays in the batch
    ids = [admission.decide(request()).row_id for _ in range(3)]
    assert len(set(ids + [ok.row_id, seeded.row_id])) == 5
    assert admission.counters.clamped >= 1 and admission.counters.rejected_budget == 1


# --- the window bounds each row, the memory budget all of a request's rows -----------------


def _ceiling(*, memory: int, window: int, state: int = 0):
    """A budget that holds `memory` tokens of one row (1 byte a token, plus `state` bytes a row)."""
    budget = TRANSIENT + memory + state
    return admission_ceiling(
        transient_bytes=TRANSIENT,
        budget_bytes=budget,
        weights_bytes=0,
        kv_bytes_per_token=1,
        context_length=window,
        state_bytes_per_row=state,
    )


def test_the_window_is_per_row_and_never_split_across_choices():
    ceiling = _ceiling(memory=10**6, window=4096)
    assert ceiling.max_safe_context == 4096 and ceiling.memory_context(1) == 10**6
    # a prompt of 3000 tokens, n=2: each choice is its own row of the 4096-token window
    assert fit_rows(ceiling, prompt_tokens=3000, max_tokens=5000, rows=2) == 1096
    assert fit_rows(ceiling, prompt_tokens=3000, max_tokens=50, rows=8) == 50
    assert fit_rows(ceiling, prompt_tokens=4096, max_tokens=1, rows=2) == "window"


def test_the_memory_budget_holds_every_row_of_a_request():
    ceiling = _ceiling(memory=5000, window=4096)
    assert ceiling.memory_context(2) == 2500  # each choice its own copy of the prompt's KV
    assert fit_rows(ceiling, prompt_tokens=3000, max_tokens=5000, rows=1) == 1096  # the window binds
    assert fit_rows(ceiling, prompt_tokens=3000, max_tokens=5000, rows=2) == "memory"
    assert fit_rows(ceiling, prompt_tokens=2000, max_tokens=5000, rows=2) == 500  # memory clamps
    # a prompt past the window is the window's refusal, whatever the memory
    assert fit_rows(_ceiling(memory=10, window=64), prompt_tokens=100, max_tokens=1, rows=2) == "window"


def test_each_row_of_a_request_brings_its_own_fixed_state():
    ceiling = _ceiling(memory=900, window=10**6, state=100)  # 1000 usable bytes
    assert ceiling.memory_context(1) == 900
    assert ceiling.memory_context(2) == 400  # 2 x (100 + 400)


async def test_n_choices_of_a_long_prompt_are_admitted_when_the_window_binds():
    sent, _ = trio.open_memory_channel(math.inf)
    admission = Admission(
        ceiling=_ceiling(memory=10**6, window=4096), mode="batch", max_queue=4, waiting=lambda: 0, scheduler=sent
    )
    for index in range(2):
        ok = admission.decide(request(3000, 5000, siblings=Siblings(key=1, index=index, count=2)))
        assert isinstance(ok, Admitted) and ok.max_tokens == 1096
    past = admission.decide(request(4096, 1, siblings=Siblings(key=2, index=0, count=2)))
    assert (past.status, past.type, past.code) == (400, "invalid_request_error", "context_length_exceeded")
    assert admission.counters.rejected_budget == 0


async def test_choices_over_the_memory_budget_are_told_so():
    sent, _ = trio.open_memory_channel(math.inf)
    admission = Admission(
        ceiling=_ceiling(memory=5000, window=4096), mode="batch", max_queue=4, waiting=lambda: 0, scheduler=sent
    )
    over = admission.decide(request(3000, 10, siblings=Siblings(key=1, index=0, count=2)))
    assert (over.status, over.type, over.code) == (400, "memory_admission", "context_over_budget")
    assert "caps safe context at 2500 for each of the request's 2 choices" in over.message
    assert "raise --memory-budget" in over.message
    assert admission.decide(request(3000, 5000)).max_tokens == 1096  # alone it fits


async def test_full_queue_and_closed_gate_are_503():
    full, _ = make_admission(waiting=5, max_queue=4)  # (the rows waiting with this one counted)
    rejected = full.decide(request())
    assert (rejected.status, rejected.code, rejected.retry_after) == (503, "queue_full", 1.0)
    admission, _ = make_admission()
    admission.close(cutoff_after=5)
    closed = admission.decide(request())
    assert (closed.status, closed.code) == (503, "shutting_down")


async def test_admitted_rows_reach_the_scheduler_with_their_seed_and_clamp():
    admission, to_scheduler = make_admission(max_safe=30)
    rows_send, _ = trio.open_memory_channel(math.inf)
    reply_send, reply_recv = trio.open_memory_channel(1)
    admission.handle(Submit(request(10, 100), rows_send, reply_send))
    admitted = reply_recv.receive_nowait()
    enqueue = to_scheduler.receive_nowait()
    assert isinstance(enqueue, Enqueue) and enqueue.rows is rows_send
    assert enqueue.spec.max_tokens == 20 and enqueue.spec.sampling.seed == admitted.seed


async def test_a_requester_gone_before_the_reply_gets_its_row_aborted():
    admission, to_scheduler = make_admission()
    rows_send, _ = trio.open_memory_channel(math.inf)
    reply_send, reply_recv = trio.open_memory_channel(1)
    reply_recv.close()
    admission.handle(Submit(request(), rows_send, reply_send))
    enqueue, abort = to_scheduler.receive_nowait(), to_scheduler.receive_nowait()
    assert abort == Abort(enqueue.spec.row_id)


async def test_a_zero_ceiling_is_a_warning_not_a_refusal(autojump_clock, caplog):
    caplog.set_level(logging.WARNING)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            FakeWorker(),
            options=serve_options(memory_budget_gb=0.001),
            make_tokenizer=lambda info: FakeTokenizer(),
        )
        assert handles.ceiling.max_safe_context == 0
        assert any("every request will be refused" in r.message for r in caplog.records)
        nursery.cancel_scope.cancel()


class RecordingObserver:
    """A `RequestObserver` that lists what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.events.append((name, *args))


async def test_the_requests_observer_is_told_the_decision_and_rides_along_to_the_scheduler():
    admission, to_scheduler = make_admission()
    observer = RecordingObserver()
    rows_send, _ = trio.open_memory_channel(math.inf)
    reply_send, reply_recv = trio.open_memory_channel(1)
    admission.handle(Submit(request(), rows_send, reply_send, observer))
    admitted = reply_recv.receive_nowait()
    assert observer.events == [("decided", admitted)]
    assert to_scheduler.receive_nowait().observer is observer
    admission.close(cutoff_after=1)
    reply_send, reply_recv = trio.open_memory_channel(1)
    admission.handle(Submit(request(), rows_send, reply_send, observer))
    assert observer.events[-1] == ("decided", reply_recv.receive_nowait())


async def test_the_observer_hears_of_a_requester_gone_before_the_reply():
    admission, _ = make_admission()
    observer = RecordingObserver()
    rows_send, _ = trio.open_memory_channel(math.inf)
    reply_send, reply_recv = trio.open_memory_channel(1)
    reply_recv.close()
    admission.handle(Submit(request(), rows_send, reply_send, observer))
    assert observer.events == [("left_before_answer",)]


# --- the wait queue: --max-queue counts only the rows that must wait -------------------------


class _Sink:
    stopped = False
    finish_reason = None

    def push(self, token_id: int) -> list[str]:
        return []

    def finish(self, *, reason: str) -> list[str]:
        return []


async def _burst(config: ServerOptions, families: list[int], later: list[int] = ()) -> list[int]:
    """Requests of `families[i]` choices (OpenAI's `n`) all submitted at the same moment, on an
    idle server, then (no time passed, every task settled) those of `later`: the status each one
    got (200 admitted)."""
    statuses: dict[int, int] = {}
    kept: list[RequestActor] = []  # an actor dropped aborts its row
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, FakeWorker(step_cost=10.0), options=config, make_tokenizer=lambda info: FakeTokenizer()
        )

        async def one(i: int, n: int) -> None:
            actors = []
            try:
                for index in range(n):  # as api/chat.py's `_admitted` admits a request's choices
                    siblings = Siblings(key=i + 1, index=index, count=n) if n > 1 else None
                    actors.append(RequestActor(handles.ports, request(5, 5, siblings=siblings), _Sink()))
                    await actors[-1].admit()
                statuses[i] = 200
                kept.extend(actors)
            except RequestRejected as rejected:
                statuses[i] = rejected.rejection.status

        async with trio.open_nursery() as burst:
            for i, n in enumerate(families):
                burst.start_soon(one, i, n)
            await trio.testing.wait_all_tasks_blocked()
            for i, n in enumerate(later, start=len(families)):
                burst.start_soon(one, i, n)
        nursery.cancel_scope.cancel()
    return [statuses[i] for i in range(len(families) + len(later))]


async def test_requests_that_fit_the_free_rows_are_not_counted_as_waiting(autojump_clock):
    # An idle server of 32 rows with --max-queue 4: 10 at once all start, none waits.
    assert await _burst(serve_options(batch=32, max_queue=4), [1] * 10) == [200] * 10
    # 40 at once: 32 start, 4 may wait, the other 4 are refused.
    statuses = await _burst(serve_options(batch=32, max_queue=4), [1] * 40)
    assert statuses.count(200) == 36 and statuses.count(503) == 4


async def test_a_serial_server_has_one_free_row(autojump_clock):
    statuses = await _burst(serve_options(batch=1, max_queue=4), [1] * 10)
    assert statuses.count(200) == 5 and statuses.count(503) == 5  # one runs, four wait


async def test_each_choice_of_a_request_takes_a_row(autojump_clock):
    # 4 rows: two requests of n=3 take 6, so 2 rows wait; with --max-queue 2 a third is refused.
    assert await _burst(serve_options(batch=4, max_queue=2), [3, 3], later=[1]) == [200, 200, 503]
    assert await _burst(serve_options(batch=4, max_queue=3), [3, 3], later=[1]) == [200, 200, 200]
    # Two requests of n=2 fill 4 rows and none waits; of two more, one may wait (--max-queue 1).
    statuses = await _burst(serve_options(batch=4, max_queue=1), [2, 2], later=[1, 1])
    assert statuses[:2] == [200, 200] and sorted(statuses[2:]) == [200, 503]


async def test_a_burst_counts_every_choice_of_the_requests_already_admitted(autojump_clock):
    # Requests arriving together: each one's first choice is decided before any request's other
    # choices are submitted, so those must count from the first. 4 rows, --max-queue 2: n=3 x3
    # takes 3 + 3 (2 wait), the third would make 5 wait; n=2 x4 takes 4 + 2 (2 wait), the fourth 4.
    # (Which of them is refused is the order the burst's tasks happen to run in.)
    assert sorted(await _burst(serve_options(batch=4, max_queue=2), [3, 3, 3])) == [200, 200, 503]
    assert sorted(await _burst(serve_options(batch=4, max_queue=2), [2, 2, 2, 2])) == [200, 200, 200, 503]
    # and a request whose choices would wait past the cap is refused whole (3 + 3 > 4 + 1)
    assert sorted(await _burst(serve_options(batch=4, max_queue=1), [3, 3])) == [200, 503]


async def test_a_request_gone_between_its_choices_leaves_no_rows_counted(autojump_clock):
    # n=3 counts 3 rows from its first choice; its client leaves before the others are submitted.
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            FakeWorker(step_cost=10.0),
            options=serve_options(batch=4, max_queue=1),
            make_tokenizer=lambda info: FakeTokenizer(),
        )
        leader = RequestActor(handles.ports, request(5, 5, siblings=Siblings(key=1, index=0, count=3)), _Sink())
        await leader.admit()
        await trio.testing.wait_all_tasks_blocked()
        assert handles.stats()["batch"]["pending_rows"] == 3
        leader.close()
        await trio.testing.wait_all_tasks_blocked()
        batch = handles.stats()["batch"]
        assert batch["pending_rows"] == 0 and batch["active_rows"] == 0
        nursery.cancel_scope.cancel()


async def test_stats_show_the_queued_rows_and_those_that_wait(autojump_clock):
    # 4 rows; requests of n=3, n=3 and 1: 7 rows admitted, 4 open at most, so 3 must wait.
    kept: list[RequestActor] = []
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            FakeWorker(step_cost=10.0),
            options=serve_options(batch=4, max_queue=8),
            make_tokenizer=lambda info: FakeTokenizer(),
        )

        async def one(key: int, n: int) -> None:
            for index in range(n):  # as api/chat.py's `_admitted`: a choice once the one before is
                siblings = Siblings(key=key, index=index, count=n) if n > 1 else None
                kept.append(RequestActor(handles.ports, request(5, 5, siblings=siblings), _Sink()))
                await kept[-1].admit()

        for key, n in enumerate([3, 3, 1], start=1):
            nursery.start_soon(one, key, n)
        await trio.testing.wait_all_tasks_blocked()
        batch = handles.stats()["batch"]
        assert batch["active_rows"] + batch["pending_rows"] == 7
        assert batch["waiting_rows"] == batch["pending_rows"] - (4 - batch["active_rows"]) == 3
        admission = handles.stats()["admission"]
        assert admission["context_length"] == 4096 and admission["memory_context"] >= 4096
        nursery.cancel_scope.cancel()
