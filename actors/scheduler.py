"""The scheduler actor: continuous batching over one GPU worker (spec §4).

Inbound:  `inbox` — `Enqueue` from admission, `Abort` / `StopRow` from request actors
          (one unbounded channel, senders use `send_nowait` so an abort never blocks).
Outbound: each row's own unbounded event channel (`RowOpened`, `TokenOut`, `RowFailed`; closed
          when the row ends), and worker calls — open_row / prefill / prefill_group / join /
          join_group / step / close_row — strictly one at a time.

Two tasks share the row table, which is safe because trio only switches at awaits and every
table mutation is synchronous: the control task applies inbound messages the moment they arrive
(so a queued row is dropped at once), and the driver task turns the table into worker calls.
A queue head that could share a group prefill (alone, or opening a group with room to spare) is
held while other requests are still on their way in (`pending_arrivals`), for at most
`arrival_window` seconds; the running streams keep stepping meanwhile.

Rows leave only between worker calls: an abort during a prefill chunk takes effect after that
chunk, one during a decode step after that step, and the aborted row's token from that call is
discarded, never delivered.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable

import attrs
import trio

from actors.messages import Abort, Control, Enqueue, RowEvent, RowFailed, StopRow
from actors.policy import GROUP_MIN_CACHED_TOKENS, LeaveReason, Row, RowTable
from actors.worker_api import Worker
from model.rows import TokenOut

log = logging.getLogger(__name__)

# Undelivered events on one row's channel that mean its reader is gone. A live reader drains its
# channel every event-loop turn; even a slow one stays far below this (~tens of seconds of decode).
DEFAULT_STALL_BACKLOG = 2048

# A queue head that could open a group prefill waits for the next turn instead of prefilling
# alone (MLX_TRIO_GROUP_HEAD_WAITS=0: the old order, for A/B measurements).
GROUP_HEAD_WAITS = os.environ.get("MLX_TRIO_GROUP_HEAD_WAITS", "1") != "0"
# For A/B measurements only: hold a groupable head for the whole arrival window even with nothing
# known to be on its way (a plain time window; every lone request then waits that long).
ARRIVAL_HOLD_ALWAYS = os.environ.get("MLX_TRIO_ARRIVAL_HOLD_ALWAYS", "0") == "1"


@attrs.define
class SchedulerCounters:
    submitted_rows: int = 0
    finished_rows: int = 0  # EOS or length
    stopped_rows: int = 0  # stop string
    aborted_rows: int = 0
    failed_rows: int = 0
    steps: int = 0
    prefill_chunks: int = 0
    group_prefills: int = 0  # prefill_group forwards (each also counts as a prefill chunk)
    grouped_rows: int = 0  # rows opened for a group prefill
    solo_rows: int = 0  # rows opened to prefill alone
    held_heads: int = 0  # queue heads held for requests still on their way in
    held_s: float = 0.0  # their total wait
    tokens: int = 0


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
    ) -> None:
        self._worker = worker
        # A joiner's prefill chunk while other rows are decoding (0 = the worker's full chunk):
        # the running streams wait for one chunk between two of their tokens, so a smaller one
        # bounds that gap (a long prompt then takes more, shorter forwards).
        self.decoding_prefill_chunk = decoding_prefill_chunk
        # Group prefill: simultaneous short arrivals are prefilled together, up to this many
        # (padded) tokens per forward; 0 = off (every row prefills alone).
        self.group_prefill_tokens = group_prefill_tokens
        self.stall_backlog = stall_backlog
        # Requests read but not yet in the inbox, and how long a lone head may wait for them.
        self._pending_arrivals = pending_arrivals
        self.arrival_window = arrival_window
        self._inbox = inbox
        self.table = RowTable(capacity)
        self.counters = SchedulerCounters()
        self._kick = trio.Event()
        self._calls = 0  # worker calls made (each one a checkpoint)
        # The last rows opened: when each reached the queue, how long it waited, with how many
        # rows it was opened (1 = alone); /stats shows it, to explain solo prefills.
        self.recent_opens: deque[tuple[int, float, float, int]] = deque(maxlen=32)

    # -- views for admission and /stats

    @property
    def waiting(self) -> int:
        """Rows waiting to be admitted, counting enqueues still in the inbox."""
        return len(self.table.queue) + self._inbox.statistics().current_buffer_used

    @property
    def active_rows(self) -> int:
        return len(self.table.running) + (self.table.joiner is not None) + len(self.table.staged)

    @property
    def busy(self) -> bool:
        """For background GPU work (durability, demotion): anything running or pending."""
        return not self.table.idle or bool(self.table.queue)

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
            for row in [*self.table.queue, *self.table.staged, *self.table.running.values(), self.table.joiner]:
                if row is not None:
                    row.out.close()

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
            row = Row(spec=message.spec, lane=message.lane, out=message.rows, enqueued_at=trio.current_time())
            self.table.enqueue(row)
            self.counters.submitted_rows += 1
        elif isinstance(message, (Abort, StopRow)):
            reason: LeaveReason = "abort" if isinstance(message, Abort) else "stop"
            dropped = self.table.mark_leaving(message.row_id, reason)
            if dropped is not None:
                self._end(dropped)
        self._kick.set()

    # -- the driver loop

    async def _drive(self) -> None:
        table = self.table
        while True:
            calls = self._calls
            self._prune_disconnected()
            await self._close_leavers()
            if table.idle:
                self._kick = trio.Event()
                await self._kick.wait()
                continue
            held = self._hold_head()
            if held is None and self.group_prefill_tokens and (group := table.admit_group(self.group_prefill_tokens)):
                await self._open_group(group)
                await self._close_leavers()
            if table.joiner is None and (ready := table.staged_ready()):
                await self._join_group(ready)
                await self._close_leavers()
            table.next_staged()
            # A head that could open a group waits one step for the next turn's group prefill
            # rather than prefilling alone now (one group forward between two decode steps). On
            # the H200 benchmark bursts it changed nothing (their rows reach the queue one at a
            # time: docs/performance.md item 24); it keeps a queued burst from alternating.
            grouped_next = (
                GROUP_HEAD_WAITS and self.group_prefill_tokens and table.group_at_head(self.group_prefill_tokens)
            )
            if held is None:
                held = self._hold_head()  # (the group above may have changed the head)
            if table.admissible_head() is not None and not grouped_next and held is None:
                self._opening([table.queue[0]])
                await self._open(table.admit())
                await self._close_leavers()
            burst = False
            joiner = table.joiner
            if joiner is not None and joiner.leaving is None:
                # One forward per iteration — a chunk, or the join's L=1 forward — so a running
                # stream never waits more than one of them between its tokens.
                if joiner.to_prefill > 0:
                    await self._prefill(joiner)
                else:
                    # Into a running batch with nobody queued behind it (a burst's rows join
                    # one by one, each giving its token 0 at once), the join rides the next step:
                    # no L=1 forward of its own for the running streams to wait for.
                    if table.running and not table.queue and not table.staged:
                        await self._join_group([joiner], staged=False)
                    else:
                        await self._join(joiner)
                    # Simultaneous arrivals form one batch: admit the next before stepping.
                    burst = bool(table.staged) or table.admissible_head() is not None
                await self._close_leavers()
            if table.running and not burst:
                await self._step()
            # No checkpoint here: after a step the loop goes straight on to submit the next one,
            # so the worker computes it while the request actors handle this step's tokens (a
            # yield here would leave the device idle for the whole of that per-token work). Every
            # worker call is itself a checkpoint; a loop turn that made none yields here.
            if calls == self._calls:
                if held is not None:
                    # Nothing to run until an arrival settles or the window closes.
                    self._kick = trio.Event()
                    with trio.move_on_at(held):
                        await self._kick.wait()
                else:
                    await trio.lowlevel.checkpoint()

    def _hold_head(self) -> float | None:
        """The deadline until which the admissible head (alone, or opening a group with room to
        spare) waits for requests still on their way in, so they share its group prefill; None =
        admit now."""
        table = self.table
        if not (self.group_prefill_tokens and self.arrival_window > 0) or table.joiner is not None:
            return None
        if not table.group_has_room(self.group_prefill_tokens):
            return None
        pending = self._pending_arrivals() + self._inbox.statistics().current_buffer_used
        if pending == 0 and not ARRIVAL_HOLD_ALWAYS:
            return None
        head = table.queue[0]
        now = trio.current_time()
        if head.held_since is None:
            head.held_since = now
        deadline = head.held_since + self.arrival_window
        return deadline if now < deadline else None

    def _opening(self, rows: list[Row]) -> None:
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
        self._deliver(row, opened)

    async def _open_group(self, rows: list[Row]) -> None:
        """Open the rows, then one prefill_group call for those still wanted; any the worker
        could not take (a cached prefix, say) keep their `to_prefill` and prefill alone later."""
        self._opening(rows)
        for row in rows:
            if row.leaving is None:
                await self._open(row, min_cached_tokens=GROUP_MIN_CACHED_TOKENS)
        wanted = [r for r in rows if r.opened and r.leaving is None and r.to_prefill > 0]
        if len(wanted) < 2:
            return
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

    async def _join_group(self, rows: list[Row], *, staged: bool = True) -> None:
        """Rows join in one call; their first tokens come with the next step (a grammar-
        constrained row's comes back here). The staged rows of a group, or (`staged=False`)
        the joiner alone."""
        try:
            self._calls += 1
            firsts = await self._worker.join_group([r.row_id for r in rows])
        except Exception as exc:
            self._fail(rows, exc, "join_group")
            return
        for row, first in zip(rows, firsts):
            if staged:
                self.table.joined_staged(row)
            else:
                self.table.joined(row)
            if first is not None:
                self._on_token(row, first)

    async def _prefill(self, row: Row) -> None:
        try:
            self._calls += 1
            limit = self.decoding_prefill_chunk if self.table.running else 0
            progress = await self._worker.prefill(row.row_id, limit or None)
        except Exception as exc:
            self._fail([row], exc, "prefill")
            return
        self.counters.prefill_chunks += 1
        row.to_prefill = progress.remaining

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

    def _on_token(self, row: Row, token: TokenOut) -> None:
        if self._deliver(row, token):
            self.counters.tokens += 1
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
        return True

    def _fail(self, rows: list[Row], exc: Exception, call: str) -> None:
        log.error("worker.%s failed for rows %s", call, [r.row_id for r in rows], exc_info=exc)
        for row in rows:
            self._deliver(row, RowFailed(row.row_id, f"generation failed: {exc}"))
            if row.leaving is None:
                row.leaving = "error"

    def _prune_disconnected(self) -> None:
        """Belt and braces for a request actor that vanished without sending Abort, and the
        guard against a client that stopped reading: hypercorn shields socket writes, so such a
        stream never errors; its row would decode to max_tokens holding KV. A backlog past
        `stall_backlog` undelivered events means nobody is reading: the row is aborted."""
        for row in [*self.table.queue, *self.table.staged, *self.table.running.values(), self.table.joiner]:
            if row is None:
                continue
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
        for row in self.table.take_leavers():
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
        row.out.close()
        match row.leaving:
            case "finish":
                self.counters.finished_rows += 1
            case "stop":
                self.counters.stopped_rows += 1
            case "abort":
                self.counters.aborted_rows += 1
            case _:
                self.counters.failed_rows += 1
