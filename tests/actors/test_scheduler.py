"""Scheduler behaviour on virtual time: batching, joins, leaves, aborts and the serial drain.

FakeWorker costs (unless a test says otherwise): open 0, prefill chunk (4 tokens) 1 s, join 1 s,
step 1 s. A prompt of n tokens needs ceil((n - 1) / 4) chunks before its join.
"""

from __future__ import annotations

import trio

from actors.messages import Abort, NullObserver, RowEvent, RowFailed, StopRow
from model.engine.rows import RowOpened, TokenOut
from tests.fakes import EOS, FakeWorker, scheduler_harness


class Observer(NullObserver):
    """Records what the scheduler tells a request's observer, with virtual timestamps."""

    def __init__(self) -> None:
        self.events: list[tuple[float, RowEvent]] = []
        self.ended: list[float] = []

    def row_event(self, event: RowEvent) -> None:
        self.events.append((trio.current_time(), event))

    def row_ended(self) -> None:
        self.ended.append(trio.current_time())


async def settle() -> None:
    """Let every runnable task run without letting virtual time advance."""
    for _ in range(5):
        await trio.lowlevel.checkpoint()


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


async def test_solo_row_prefills_in_chunks_then_decodes(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        row = h.submit(1, prompt(9), max_tokens=4)
        await trio.sleep(20)
    assert isinstance(row.events[0][1], RowOpened)
    assert row.tokens == worker.expected(prompt(9), 4)
    # 2 chunks (0-2), join (2-3) gives token 0, then one token per step.
    assert row.token_times == [3, 4, 5, 6]
    assert worker.closed[1] == (6, True)
    assert row.ended_at == 6
    assert not worker.violations


async def test_simultaneous_arrivals_form_one_batch(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        rows = [h.submit(i, prompt(1, salt=i), max_tokens=3) for i in (1, 2, 3)]
        await trio.sleep(20)
    # Three joins back to back (burst), then every step runs the three together; the last
    # joiner, with nobody left to admit, gets its token 0 from that first step (join_group).
    assert [call for _, call, _ in worker.calls[:7]] == ["open_row", "join"] * 2 + ["open_row", "join_group", "step"]
    assert worker.calls[5][2] == (3,)
    # Rows 1 and 2 got token 0 from their joins, row 3 from the first step: it needs one more.
    assert worker.batches() == [(3, (1, 2, 3)), (4, (1, 2, 3)), (5, (3,))]
    # (the fake charges join_group a join's 1 s; the engine's runs no forward)
    assert [row.token_times[0] for row in rows] == [1, 2, 4]
    for i, row in zip((1, 2, 3), rows):
        assert row.tokens == worker.expected(prompt(1, salt=i), 3)
    assert not worker.violations


async def test_joiner_prefill_interleaves_with_running_steps(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        running = h.submit(1, prompt(1), max_tokens=12)
        await trio.sleep(2.5)
        joiner = h.submit(2, prompt(17, salt=5), max_tokens=3)  # 4 chunks
        await trio.sleep(30)
    # While the joiner prefills, a step runs after every chunk: the running stream never
    # waits more than one chunk (+ its own step) between tokens.
    gaps = [b - a for a, b in zip(running.token_times, running.token_times[1:])]
    assert max(gaps) <= worker.prefill_cost + worker.step_cost
    names = [c for _, c, arg in worker.calls if arg == 2 or c == "step"]
    first_prefill = names.index("prefill")
    assert names[first_prefill : first_prefill + 8] == ["prefill", "step"] * 4
    assert running.tokens == worker.expected(prompt(1), 12)
    assert joiner.tokens == worker.expected(prompt(17, salt=5), 3)
    assert not worker.violations


async def test_a_joiner_prefills_in_smaller_chunks_only_while_others_decode(autojump_clock):
    worker = FakeWorker(chunk=8)
    async with scheduler_harness(worker, decoding_prefill_chunk=2) as h:
        first = h.submit(1, prompt(17), max_tokens=3)  # alone: 16 tokens in two full chunks
        await trio.sleep(2.5)
        assert worker.prefill_limits == [None, None]
        await trio.sleep(10)
        assert first.ended_at is not None
        running = h.submit(2, prompt(1), max_tokens=20)
        await trio.sleep(2.5)
        joiner = h.submit(3, prompt(9, salt=5), max_tokens=3)  # 8 tokens, 2 at a time beside row 2
        await trio.sleep(40)
    assert worker.prefill_limits == [None, None, 2, 2, 2, 2]
    # Each 2-token chunk is followed by a step of the running row: it waits one chunk at most.
    names = [c for _, c, arg in worker.calls if arg == 3 or c == "step"]
    first_prefill = names.index("prefill")
    assert names[first_prefill : first_prefill + 8] == ["prefill", "step"] * 4
    gaps = [b - a for a, b in zip(running.token_times, running.token_times[1:])]
    assert max(gaps) <= worker.prefill_cost + worker.step_cost
    assert joiner.tokens == worker.expected(prompt(9, salt=5), 3)
    assert running.tokens == worker.expected(prompt(1), 20)
    assert not worker.violations


async def test_a_lone_joiner_rides_the_next_step_instead_of_a_join_forward(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        running = h.submit(1, prompt(1), max_tokens=10)
        await trio.sleep(2.5)
        joiner = h.submit(2, prompt(3, salt=7), max_tokens=4)  # 1 chunk, nobody queued behind it
        await trio.sleep(30)
    calls = [(c, arg) for _, c, arg in worker.calls if arg in (2, (2,)) or c == "join"]
    assert ("join_group", (2,)) in calls and ("join", 2) not in calls
    # its token 0 comes with the first step that includes it, and every token is its own
    first_with_2 = next(t for t, ids in worker.batches() if 2 in ids)
    assert joiner.token_times[0] == first_with_2 + worker.step_cost
    assert joiner.tokens == worker.expected(prompt(3, salt=7), 4)
    assert running.tokens == worker.expected(prompt(1), 10)
    assert not worker.violations


async def test_rows_leave_mid_flight_and_the_batch_shrinks(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        rows = {i: h.submit(i, prompt(1, salt=i), max_tokens=n) for i, n in ((1, 2), (2, 5), (3, 8))}
        await trio.sleep(6.5)
        late = h.submit(4, prompt(1, salt=4), max_tokens=3)  # joins mid-flight
        await trio.sleep(30)
    sizes = [ids for _, ids in worker.batches()]
    assert sizes[0] == (1, 2, 3)
    assert (2, 3) in sizes  # row 1 left after 2 tokens
    assert any(4 in ids for ids in sizes) and all(1 not in ids for ids in sizes if 4 in ids)
    for i, row in rows.items():
        assert row.tokens == worker.expected(prompt(1, salt=i), (2, 5, 8)[i - 1])
    assert late.tokens == worker.expected(prompt(1, salt=4), 3)
    # Each row was closed exactly at the boundary of the call that produced its last token.
    for i, row in {**rows, 4: late}.items():
        assert worker.closed[i][0] == row.token_times[-1]
    assert not worker.violations


async def test_eos_ends_the_row_with_stop(autojump_clock):
    worker = FakeWorker(eos_at=lambda spec: 2)
    async with scheduler_harness(worker) as h:
        row = h.submit(1, prompt(1), max_tokens=10)
        await trio.sleep(20)
    last = row.events[-1][1]
    assert isinstance(last, TokenOut) and last.token == EOS and last.finish == "stop"
    assert len(row.tokens) == 3
    assert h.scheduler.counters.finished_rows == 1


async def test_abort_while_queued_drops_the_row_at_once(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=1) as h:
        h.submit(1, prompt(1), max_tokens=10)
        queued = h.submit(2, prompt(1, salt=2), max_tokens=10, collect=False)
        await trio.sleep(2.5)
        assert len(h.scheduler.table.queue) == 1
        h.receivers[2].close()
        h.inbox.send_nowait(Abort(2))
        await settle()  # the control task runs; no worker call has to finish first
        assert trio.current_time() == 2.5
        assert len(h.scheduler.table.queue) == 0
        await trio.sleep(20)
    assert 2 not in [arg for _, _, arg in worker.calls]
    assert h.scheduler.counters.aborted_rows == 1
    assert queued.events == []
    assert not worker.violations


async def test_abort_mid_prefill_stops_the_running_chunk(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        row = h.submit(1, prompt(17), max_tokens=4)  # 4 chunks: 0-1, 1-2, 2-3, 3-4
        await trio.sleep(1.5)
        h.receivers[1].close()
        h.inbox.send_nowait(Abort(1))
        await trio.sleep(20)
    assert worker.aborts == {1: 1.5}  # passed to the worker while its chunk ran
    assert worker.closed[1] == (1.5, False)  # that chunk stopped at once, then out; aborts are not put
    assert [c for _, c, _ in worker.calls] == ["open_row", "prefill", "prefill", "close_row"]
    assert row.tokens == []
    assert not worker.violations


async def test_abort_mid_decode_releases_at_the_next_step_and_spares_others(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        victim = h.submit(1, prompt(1, salt=1), max_tokens=20)
        other = h.submit(2, prompt(1, salt=2), max_tokens=8)
        await trio.sleep(5.5)  # mid-step (steps run 2-3, 3-4, ...)
        aborted_at = trio.current_time()
        h.inbox.send_nowait(Abort(1))
        await trio.sleep(30)
    assert all(t <= aborted_at for t in victim.token_times)
    assert worker.closed[1][0] == 6.0  # the step in flight at 5.5 ends at 6; no later step has it
    assert all(1 not in ids for t, ids in worker.batches() if t >= 6.0)
    assert other.tokens == worker.expected(prompt(1, salt=2), 8)
    assert not worker.violations


async def test_a_closed_receiver_alone_aborts_the_row(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        h.submit(1, prompt(1), max_tokens=50, collect=False)
        await trio.sleep(3.5)
        h.receivers[1].close()  # no Abort message: the request vanished
        await trio.sleep(10)
    assert worker.closed[1][0] == 4.0
    assert h.scheduler.counters.aborted_rows == 1


async def test_stop_row_ends_the_row_cleanly(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        row = h.submit(1, prompt(1), max_tokens=50)
        await trio.sleep(3.5)
        h.inbox.send_nowait(StopRow(1))
        await trio.sleep(10)
    assert worker.closed[1] == (4.0, True)
    assert row.ended_at == 4.0
    assert h.scheduler.counters.stopped_rows == 1


async def test_serial_row_drains_the_batch_and_runs_alone(autojump_clock):
    worker = FakeWorker()
    logs = {}
    async with scheduler_harness(worker, capacity=4) as h:

        async def steady_batch_traffic():
            for i in range(1, 13):
                logs[i] = h.submit(i, prompt(1, salt=i), max_tokens=3)
                await trio.sleep(1)

        async with trio.open_nursery() as n:
            n.start_soon(steady_batch_traffic)
            await trio.sleep(2.5)
            serial = h.submit(100, prompt(5), max_tokens=4, lane="serial")
        await trio.sleep(60)
    opened = {arg: t for t, c, arg in worker.calls if c == "open_row"}
    serial_start, serial_end = opened[100], worker.closed[100][0]
    # Everything before the serial row finished before it started (drain) ...
    assert all(worker.closed[i][0] <= serial_start for i in logs if i <= 3)
    # ... it ran alone ...
    assert all(ids == (100,) for t, ids in worker.batches() if serial_start <= t < serial_end)
    # ... and batch rows that arrived after it waited for it, then all completed.
    assert all(opened[i] >= serial_end for i in logs if i > 3)
    assert serial.tokens == worker.expected(prompt(5), 4)
    for i, row in logs.items():
        assert row.tokens == worker.expected(prompt(1, salt=i), 3)
    assert not worker.violations


async def test_batch_rows_are_not_starved_behind_a_serial_queue(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=4) as h:
        h.submit(1, prompt(1, salt=1), max_tokens=3, lane="serial")
        h.submit(2, prompt(1, salt=2), max_tokens=3, lane="batched")
        h.submit(3, prompt(1, salt=3), max_tokens=3, lane="serial")
        h.submit(4, prompt(1, salt=4), max_tokens=3, lane="serial")
        await trio.sleep(60)
    order = [arg for _, c, arg in worker.calls if c == "open_row"]
    assert order == [1, 2, 3, 4]  # FIFO across lanes: the batch row is not overtaken
    assert all(len(ids) == 1 for _, ids in worker.batches())


async def test_capacity_one_is_a_strict_serial_executor(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker, capacity=1) as h:
        rows = [h.submit(i, prompt(3, salt=i), max_tokens=3, lane="serial") for i in (1, 2, 3)]
        await trio.sleep(60)
    assert all(len(ids) == 1 for _, ids in worker.batches())
    spans = [(min(r.token_times), r.ended_at) for r in rows]
    assert spans == sorted(spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


async def test_a_failed_step_fails_the_running_rows_and_the_scheduler_carries_on(autojump_clock):
    worker = FakeWorker(fail_step_at=2)
    async with scheduler_harness(worker) as h:
        doomed = h.submit(1, prompt(1), max_tokens=10)
        await trio.sleep(10)
        later = h.submit(2, prompt(1, salt=2), max_tokens=3)
        await trio.sleep(10)
    assert isinstance(doomed.events[-1][1], RowFailed)
    assert worker.closed[1][1] is False  # never reusable after an error
    assert later.tokens == worker.expected(prompt(1, salt=2), 3)


async def test_a_row_nobody_reads_is_aborted_once_its_backlog_passes_the_limit(autojump_clock):
    worker = FakeWorker()
    async with scheduler_harness(worker) as h:
        h.scheduler.stall_backlog = 5
        reader = h.submit(1, prompt(3), max_tokens=40)
        h.submit(2, prompt(3, salt=50), max_tokens=40, collect=False)  # a client that stopped reading
        await trio.sleep(200)
        stalled = h.receivers[2]
        unread = stalled.statistics().current_buffer_used
    assert 2 in worker.closed and worker.closed[2][1] is False  # aborted: not put back
    assert unread <= 5 + 2  # RowOpened + a token or two past the limit, not 40 tokens
    assert h.scheduler.counters.aborted_rows == 1
    assert reader.tokens == worker.expected(prompt(3), 40)  # the reading row is untouched


async def test_the_observer_sees_each_delivered_event_and_the_end(autojump_clock):
    worker = FakeWorker()
    seen = {i: Observer() for i in (1, 2, 3)}
    async with scheduler_harness(worker, capacity=1) as h:
        rows = {i: h.submit(i, prompt(5, salt=i), max_tokens=4, observer=seen[i]) for i in (1, 2, 3)}
        await trio.sleep(2.5)  # row 1 prefills; rows 2 and 3 queue behind it
        h.inbox.send_nowait(Abort(3))  # queued: dropped at once
        await settle()
        assert seen[3].ended == [2.5]
        await trio.sleep(0.75)
        h.inbox.send_nowait(Abort(1))  # mid-step: that step's token is discarded
        await trio.sleep(30)
    for i in (1, 2):
        assert seen[i].events == rows[i].events  # exactly what the channel delivered
        assert seen[i].ended == [rows[i].ended_at]
    # Row 1: opened at 0, token 0 from its join at 2, one step's token at 3; the step in flight
    # at the abort (3-4) is discarded, for the observer too.
    assert isinstance(seen[1].events[0][1], RowOpened) and rows[1].token_times == [2, 3]
    assert worker.closed[1] == (4.0, False)
    assert seen[3].events == [] and rows[3].events == []
    assert rows[2].tokens == worker.expected(prompt(5, salt=2), 4)


async def test_cancellation_ends_every_row_and_tells_its_observer(autojump_clock):
    worker = FakeWorker()
    seen = {i: Observer() for i in (1, 2, 3)}
    async with scheduler_harness(worker, capacity=1) as h:
        for i in (1, 2, 3):
            h.submit(i, prompt(1, salt=i), max_tokens=50, observer=seen[i])
        await trio.sleep(5.5)  # row 1 decodes, 2 and 3 are queued
    # The harness cancelled the scheduler: every row's stream ended, running or queued.
    assert [seen[i].ended for i in (1, 2, 3)] == [[5.5], [5.5], [5.5]]
    assert len(seen[1].events) > 1 and seen[2].events == seen[3].events == []


async def test_cancellation_during_a_close_still_ends_the_other_leavers(autojump_clock):
    worker = FakeWorker(close_cost=1.0)
    seen = {i: Observer() for i in (1, 2)}
    async with scheduler_harness(worker) as h:
        rows = {i: h.submit(i, prompt(1, salt=i), max_tokens=n, observer=seen[i]) for i, n in ((1, 2), (2, 1))}
        await trio.sleep(3.5)  # both rows finished with the step at 3; close_row(1) runs 3-4
        assert [arg for _, call, arg in worker.calls if call == "close_row"] == [1]
    assert [seen[i].ended for i in (1, 2)] == [[3.0], [3.5]]  # row 2: ended by the cancellation
    assert len(rows[2].tokens) == 1


async def test_a_dead_engine_is_logged_as_one_line_not_a_traceback(autojump_clock, caplog):
    """A worker that died (an isolated engine killed, the MLX thread gone) says why itself: the
    scheduler's line for each call it cut names the cause without the link's traceback."""
    from actors.mlx_thread import WorkerDied

    class Dying(FakeWorker):
        async def step(self) -> list[TokenOut]:
            if self._steps >= 2:
                raise WorkerDied("the model's engine process died during the call")
            return await super().step()

    async with scheduler_harness(Dying()) as h:
        row = h.submit(1, (5, 6, 7), max_tokens=10)
        await trio.sleep(30)
    assert isinstance(row.events[-1][1], RowFailed)
    lines = [r for r in caplog.records if "worker.step failed" in r.getMessage()]
    assert lines and all(r.exc_info is None for r in lines)
    assert "engine process died" in lines[0].getMessage()
