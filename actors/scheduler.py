"""The scheduler actor: continuous batching over one GPU worker.

Inbound:  `inbox` — `Enqueue` from admission, `Abort` / `StopRow` from request actors, `WorkerLost`
          from an isolated worker (one unbounded channel, senders use `send_nowait`: never blocks).
Outbound: each row's own unbounded event channel (`RowOpened`, `TokenOut`, `RowFailed`; closed
          when the row ends), and worker calls — open_row / prefill / prefill_group / join /
          join_group / step / close_row — strictly one at a time.

Two tasks share the row table (`actors/row_table.py`), which is safe because trio only switches
at awaits and every table mutation is synchronous: the control task applies inbound messages the
moment they arrive (so a queued row is dropped at once), and the driver task turns the table into
worker calls. The driver decides nothing itself: it asks `actors/scheduling.py`'s `decide` for the
next action and carries it out. A queue head that could share a group prefill (alone, or opening
a group with room to spare) is held while other requests are still on their way in
(`pending_arrivals`), for at most `arrival_window` seconds; the running streams keep stepping
meanwhile.

Rows leave only between worker calls: an abort during a decode step takes effect after that
step, and the aborted row's token from that call is discarded, never delivered. An abort during a
prefill is also passed to the worker at once (`Worker.abort`), so the chunk stops at its next
check between layers instead of running to its end; the row then leaves as after any call.
Each row's `RequestObserver` is told of every event delivered on its channel, of each prefill
forward of the row, of its preemption and of the channel's close. With a live-KV budget
(`actors/kv_memory.py`), a preempted row's stream pauses and it resumes from the queue head.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import trio

from actors.kv_memory import PREEMPT_RETAIN_S, KvBudget, preemptible, resumed_spec
from actors.messages import Abort, Control, Enqueue, RowEvent, RowFailed, StopRow, WorkerLost
from actors.mlx_thread import WorkerDied
from actors.row_table import LeaveReason, Row, RowTable, rows_enqueued
from actors.scheduler_counters import SchedulerCounters
from actors.scheduling import (
    GROUP_MIN_CACHED_TOKENS,
    Action,
    EndTurn,
    Fork,
    Hold,
    Join,
    JoinStaged,
    Open,
    OpenGroup,
    Preempt,
    Prefill,
    Promote,
    Settings,
    Step,
    Turn,
    Wait,
    decide,
    joined_in_burst,
)
from actors.worker_api import AdapterNotMounted, Worker
from model.engine.rows import TokenOut

log = logging.getLogger(__name__)

# Undelivered events on one row's channel that mean its reader is gone. A live reader drains its
# channel every event-loop turn; even a slow one stays far below this (~tens of seconds of decode).
DEFAULT_STALL_BACKLOG = 2048


class Scheduler:
    def __init__(
        self,
        worker: Worker,
        *,
        capacity: int,
        inbox: trio.MemoryReceiveChannel[Control],
        stall_backlog: int = DEFAULT_STALL_BACKLOG,
        group_prefill_tokens: int = 0,
        decoding_prefill_chunk: int = 0,
        pending_arrivals: Callable[[], int] = lambda: 0,
        arrival_window: float = 0.0,
        kv_budget: KvBudget | None = None,
        preempts: bool = False,
        step_tokens: int = 1,
    ) -> None:
        """`kv_budget`: the live-KV budget all active rows share (None: `capacity` alone bounds
        them); `preempts`: the model's KV comes back exactly from the prompt cache, so a row may be
        preempted (`preemptible`); `step_tokens`: positions one decode step adds to a row."""
        self._worker = worker
        # decoding_prefill_chunk: the running streams wait for one chunk between two of their
        # tokens, so a smaller one bounds that gap (a long prompt then takes more, shorter forwards).
        self.settings = Settings(
            group_prefill_tokens=group_prefill_tokens,
            decoding_prefill_chunk=decoding_prefill_chunk,
            arrival_window=arrival_window,
            step_tokens=max(1, step_tokens),
        )
        self.preempts = preempts
        self.stall_backlog = stall_backlog
        # Requests read but not yet in the inbox: a held head waits for them.
        self._pending_arrivals = pending_arrivals
        self._inbox = inbox
        self.table = RowTable(capacity, kv_budget)
        self.counters = SchedulerCounters()
        self._rows_applied = 0  # the rows of the `Enqueue`s applied, counted as admission counts them
        self._kick = trio.Event()
        self._calls = 0  # worker calls made (each one a checkpoint)
        self._leaving: deque[Row] = deque()  # rows taken out of the table, their streams still open
        # The last rows opened: when each reached the queue, how long it waited, with how many
        # rows it was opened (1 = alone); /stats shows it, to explain solo prefills.
        self.recent_opens: deque[tuple[int, float, float, int]] = deque(maxlen=32)

    # -- views for admission and /stats

    def pending_rows(self, enqueued: int) -> int:
        """Rows admitted and not opened yet (each choice of a request is one, counted from its
        first choice's admission: `rows_enqueued`), `enqueued` being admission's count of the rows
        it ever sent here: those not applied yet are on their way. (The inbox's buffer misses
        some: one handed to the waiting receiver is in no buffer until it runs.)"""
        return self.table.queued_rows + enqueued - self._rows_applied

    @property
    def active_rows(self) -> int:
        return self.table.active_rows

    @property
    def busy(self) -> bool:
        """For background GPU work (durability, demotion): anything running or pending."""
        return not self.table.idle or bool(self.table.queue)

    @property
    def kv_budget(self) -> KvBudget | None:
        return self.table.memory

    @kv_budget.setter
    def kv_budget(self, budget: KvBudget | None) -> None:
        """A new live-KV budget (mounted adapters' weights came out of it); re-decide at once."""
        self.table.memory = budget
        self._kick.set()

    def nudge(self) -> None:
        """Re-decide now (an arrival the driver may be holding the head for has settled)."""
        self._kick.set()

    # -- the actor

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive_control)
                task_status.started()
                await self._drive()
        finally:
            # Cancelled (shutdown): end every stream so no request waits on a dead scheduler.
            for row in [*self._leaving, *self.table.rows()]:
                self._close(row)

    async def _receive_control(self) -> None:
        async for message in self._inbox:
            self.apply(message)
            # Everything already waiting is applied before the driver runs, so arrivals that
            # came together are seen together (one group prefill, one batch).
            while True:
                try:
                    self.apply(self._inbox.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break

    def apply(self, message: Control) -> None:
        if isinstance(message, Enqueue):
            row = Row(
                spec=message.spec,
                lane=message.lane,
                out=message.rows,
                observer=message.observer,
                enqueued_at=trio.current_time(),
            )
            row.preemptible = self.preempts and preemptible(message.spec)
            if message.siblings is not None:
                self.table.enqueue_sibling(row, message.siblings)
            else:
                self.table.enqueue(row)
            self.counters.submitted_rows += 1
            self._rows_applied += rows_enqueued(message.siblings)
        elif isinstance(message, (Abort, StopRow)):
            reason: LeaveReason = "abort" if isinstance(message, Abort) else "stop"
            dropped = self.table.mark_leaving(message.row_id, reason)
            if dropped is not None:
                self._end(dropped)
            elif reason == "abort":
                active = self.table.active(message.row_id)
                if active is not None and active.opened:
                    # A prefill of it running now stops between layers, not after its chunk.
                    self._worker.abort(message.row_id)
        elif isinstance(message, WorkerLost) and (lost := [r for r in self.table.rows() if r.opened and not r.leaving]):
            self._fail(lost, message.error, "lost")
        self._kick.set()

    # -- the driver loop: carries out what `decide` says, one action at a time

    async def _drive(self) -> None:
        table, settings = self.table, self.settings
        holds = bool(settings.group_prefill_tokens and settings.arrival_window > 0)
        while True:
            start = self._calls
            self._prune_disconnected()
            await self._close_leavers()
            turn = Turn(called=self._calls != start)
            while True:
                pending = (self._pending_arrivals() + self._inbox.statistics().current_buffer_used) if holds else 0
                action = decide(table, trio.current_time(), pending, settings, turn)
                if isinstance(action, Wait):
                    self._kick = trio.Event()
                    with trio.move_on_at(float("inf") if action.until is None else action.until):
                        await self._kick.wait()
                    break
                if isinstance(action, EndTurn):
                    # No checkpoint after a turn that made a worker call (each is one): after a
                    # step the next turn goes straight on to submit the next one, so the worker
                    # computes it while the request actors handle this step's tokens (a yield
                    # here would leave the device idle for all that per-token work).
                    if action.checkpoint:
                        await trio.lowlevel.checkpoint()
                    break
                burst = await self._execute(action)
                turn = turn.after(action, called=self._calls != start, burst=burst)

    async def _execute(self, action: Action) -> bool:
        """Carry out one action of a turn; True = a join left more rows to admit (a burst)."""
        table = self.table
        match action:
            case Hold(row=row, since=since):
                if row.held_since is None:
                    row.held_since = since
                return False
            case Promote(row=row):
                table.promote(row)
                return False
            case Step():
                await self._step()  # (its leavers go at the next turn's start)
                self._note_kv()
                return False
            case Preempt(row=row):
                await self._preempt(row)
            case OpenGroup(rows=rows):
                table.admit_group(rows)
                await self._open_group(rows)
            case JoinStaged(rows=rows):
                await self._join_group(rows, staged=True)
            case Open(row=row):
                self._opening([row])
                table.admit(row)
                await self._open(row)
            case Prefill(row=row, limit=limit):
                await self._prefill(row, limit)
            case Fork(row=row):
                await self._fork(row)
            case Join(row=row, riding=riding):
                if riding:
                    await self._join_group([row], staged=False)
                else:
                    await self._join(row)
                burst = joined_in_burst(table)  # read right after the join, before the leavers go
                await self._close_leavers()
                return burst
            case Wait() | EndTurn():
                raise AssertionError(f"{action!r} is the driver's own")
        await self._close_leavers()
        return False

    def _opening(self, rows: Sequence[Row]) -> None:
        now = trio.current_time()
        if len(rows) == 1:
            self.counters.solo_rows += 1
        else:
            self.counters.grouped_rows += len(rows)
        for row in rows:
            if row.held_since is not None:
                self.counters.held_heads += 1
                self.counters.held_s += now - row.held_since
            self.recent_opens.append((row.row_id, row.enqueued_at, now - row.enqueued_at, len(rows)))

    async def _open(self, row: Row, *, min_cached_tokens: int = 1) -> None:
        spec = row.spec if min_cached_tokens <= 1 else attrs.evolve(row.spec, min_cached_tokens=min_cached_tokens)
        try:
            self._calls += 1
            opened = await self._worker.open_row(spec)
        except Exception as exc:
            self._fail([row], exc, "open_row")
            return
        row.opened = True
        row.to_prefill = opened.to_prefill
        if row.resuming:  # its reader saw it open the first time: nothing to tell
            row.resuming = False
            self.counters.resumes += 1
        else:
            self._deliver(row, opened)
        self._note_kv()

    async def _open_group(self, rows: Sequence[Row]) -> None:
        """Open the rows, then one prefill_group call for those still wanted; any the worker
        could not take (a cached prefix, say) keep their `to_prefill` and prefill alone later."""
        self._opening(rows)
        for row in rows:
            if row.leaving is None:
                await self._open(row, min_cached_tokens=GROUP_MIN_CACHED_TOKENS)
        wanted = [r for r in rows if r.opened and r.leaving is None and r.to_prefill > 0]
        if len(wanted) < 2:
            return
        started = trio.current_time()
        try:
            self._calls += 1
            progress = await self._worker.prefill_group([r.row_id for r in wanted])
        except Exception as exc:
            self._fail(wanted, exc, "prefill_group")
            return
        self.counters.prefill_chunks += 1
        self.counters.group_prefills += 1
        by_id = {r.row_id: r for r in wanted}
        for p in progress:
            by_id[p.row_id].to_prefill = p.remaining
            by_id[p.row_id].observer.prefilled(started, p.done, p.remaining, len(wanted))

    async def _join_group(self, rows: Sequence[Row], *, staged: bool) -> None:
        """Rows join in one call; their first tokens come with the next step (a grammar-
        constrained row's comes back here). The staged rows of a group, or (`staged=False`)
        the joiner alone."""
        try:
            self._calls += 1
            firsts = await self._worker.join_group([r.row_id for r in rows])
        except Exception as exc:
            self._fail(list(rows), exc, "join_group")
            return
        for row, first in zip(rows, firsts):
            if staged:
                self.table.joined_staged(row)
            else:
                self.table.joined(row)
            if first is not None:
                self._on_token(row, first)

    async def _prefill(self, row: Row, limit: int | None) -> None:
        started = trio.current_time()
        try:
            self._calls += 1
            progress = await self._worker.prefill(row.row_id, limit)
        except Exception as exc:
            self._fail([row], exc, "prefill")
            return
        self.counters.prefill_chunks += 1
        row.to_prefill = progress.remaining
        row.observer.prefilled(started, progress.done, progress.remaining, 1)

    async def _fork(self, leader: Row) -> None:
        """The prefilled leader's siblings are opened from its KV: staged, they join after it."""
        rows = self.table.fork(leader)
        if not rows:
            return
        try:
            self._calls += 1
            opened = await self._worker.fork_rows(leader.row_id, [r.spec for r in rows])
        except Exception as exc:
            self._fail(rows, exc, "fork_rows")
            return
        self.counters.forked_rows += len(rows)
        for row, event in zip(rows, opened):
            row.opened, row.to_prefill = True, event.to_prefill
            self._deliver(row, event)
        self._note_kv()  # (the choices are rows of their own from here on)

    async def _join(self, row: Row) -> None:
        try:
            self._calls += 1
            token = await self._worker.join(row.row_id)
        except Exception as exc:
            self._fail([row], exc, "join")
            return
        self.table.joined(row)
        self._on_token(row, token)

    async def _step(self) -> None:
        rows = dict(self.table.running)
        try:
            self._calls += 1
            tokens = await self._worker.step()
        except Exception as exc:
            # A forward/sampling error leaves the batch state unknown: drop every running row.
            self._fail(list(rows.values()), exc, "step")
            return
        self.counters.steps += 1
        for token in tokens:
            row = rows.get(token.row_id)
            if row is not None:
                self._on_token(row, token)

    async def _preempt(self, row: Row) -> None:
        """The row goes back to the queue head as a row whose prompt ends with what it generated
        (`RowSpec.resumed`); its KV is put in the prompt cache, protected, so it reopens as a hit
        and goes on with exactly the tokens it would have produced. Its stream just pauses."""
        resumed = resumed_spec(row.spec, row.generated)
        self.table.preempt(row, resumed)
        self.counters.preemptions += 1
        row.observer.preempted()
        log.info("row %d preempted after %d tokens: the live-KV budget is full", row.row_id, resumed.resumed)
        try:
            self._calls += 1
            await self._worker.close_row(row.row_id, reusable=True, retain_s=PREEMPT_RETAIN_S)
        except Exception:
            log.exception("worker.close_row(%d) failed", row.row_id)  # (it resumes as a cache miss)

    def _note_kv(self) -> None:
        self.counters.peak_kv_bytes = max(self.counters.peak_kv_bytes, self.table.kv_bytes())

    def _on_token(self, row: Row, token: TokenOut) -> None:
        if token.finish is None:
            row.generated.append(token.token)  # (a preempted row resumes from them)
        if self._deliver(row, token):
            self.counters.tokens += 1
            self.counters.drafted_tokens += token.drafted
            self.counters.accepted_tokens += token.accepted
        if token.finish is not None and row.leaving is None:
            row.leaving = "finish"

    def _deliver(self, row: Row, event: RowEvent) -> bool:
        if row.leaving is not None:
            return False  # aborted or stopped during the call: the result is discarded
        try:
            row.out.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            row.leaving = "abort"  # the request actor is gone
            return False
        row.observer.row_event(event)
        return True

    def _fail(self, rows: list[Row], exc: Exception, call: str) -> None:
        if isinstance(exc, AdapterNotMounted):  # unmounted after the route's check: that request's 400
            log.info("worker.%s refused rows %s: %s", call, [r.row_id for r in rows], exc)
            failed = RowFailed(0, str(exc), status=400)
        else:  # (a dead engine, WorkerDied: its worker logs the cause, so no traceback here)
            trace = None if isinstance(exc, WorkerDied) else exc
            log.error("worker.%s failed for rows %s: %s", call, [r.row_id for r in rows], exc, exc_info=trace)
            # A worker that cannot go on at all (a tensor-parallel rank lost) says 503 itself.
            failed = RowFailed(0, f"generation failed: {exc}", status=getattr(exc, "status", 500))
        for row in rows:
            self._deliver(row, attrs.evolve(failed, row_id=row.row_id))
            if row.leaving is None:
                row.leaving = "error"

    def _prune_disconnected(self) -> None:
        """Belt and braces for a request actor that vanished without sending Abort, and the
        guard against a client that stopped reading: hypercorn shields socket writes, so such a
        stream never errors; its row would decode to max_tokens holding KV. A backlog past
        `stall_backlog` undelivered events means nobody is reading: the row is aborted."""
        for row in self.table.rows():
            stats = row.out.statistics()
            stalled = stats.current_buffer_used > self.stall_backlog
            if stalled and row.leaving is None:
                log.warning(
                    "row %d: %d tokens unread, the client stopped reading: aborting it",
                    row.row_id,
                    stats.current_buffer_used,
                )
            if stats.open_receive_channels == 0 or stalled:
                dropped = self.table.mark_leaving(row.row_id, "abort")
                if dropped is not None:
                    self._end(dropped)

    async def _close_leavers(self) -> None:
        # Out of the table but not yet ended: the cancellation `finally` ends them too.
        self._leaving.extend(self.table.take_leavers())
        while self._leaving:
            row = self._leaving.popleft()
            self._end(row)
            if not row.opened:
                continue
            try:
                # Only rows that ended cleanly go back to the prompt cache: an abort frees its
                # KV at once (no extraction copy on the way out) and a failed row is poisoned.
                self._calls += 1
                await self._worker.close_row(row.row_id, reusable=row.leaving in ("finish", "stop"))
            except Exception:
                log.exception("worker.close_row(%d) failed", row.row_id)

    def _end(self, row: Row) -> None:
        self._close(row)
        match row.leaving:
            case "finish":
                self.counters.finished_rows += 1
            case "stop":
                self.counters.stopped_rows += 1
            case "abort":
                self.counters.aborted_rows += 1
            case _:
                self.counters.failed_rows += 1

    def _close(self, row: Row) -> None:
        """End the row's stream: the request actor sees its channel close."""
        row.out.close()
        row.observer.row_ended()
