"""The scheduler's row table: which rows are queued, staged, joining and running.

Plain state and the FIFO admission rule; no trio, no I/O. `actors/scheduling.py` reads it to
decide what happens next and `actors/scheduler.py` changes it as it carries the decisions out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import attrs

from actors.kv_memory import GROWTH_TOKENS, KvBudget
from actors.messages import NULL_OBSERVER, Lane, RequestObserver, RowEvent, Siblings
from model.engine.rows import RowSpec

if TYPE_CHECKING:
    import trio

Phase = Literal["queued", "joining", "running"]
LeaveReason = Literal["finish", "stop", "abort", "error"]


@attrs.define(eq=False)
class Row:
    spec: RowSpec
    lane: Lane
    out: trio.MemorySendChannel[RowEvent]  # the row's event channel; closing it ends the row
    observer: RequestObserver = NULL_OBSERVER  # told of every delivered event and of the end
    seq: int = 0  # arrival order
    phase: Phase = "queued"
    leaving: LeaveReason | None = None  # set once; the first reason wins
    to_prefill: int = 0
    opened: bool = False  # the worker holds state for it (close_row owed)
    enqueued_at: float = 0.0  # trio time it reached the scheduler
    held_since: float | None = None  # when the scheduler first held it at the head for arrivals
    family: Family | None = None  # a leader's, until it forks its KV into its siblings
    # Live-KV budget: tokens delivered so far (a preempted row resumes from them), times it was
    # preempted, and whether it may be (`Scheduler` decides: its KV must come back exactly).
    generated: list[int] = attrs.Factory(list)
    preemptions: int = 0
    preemptible: bool = True
    resuming: bool = False  # preempted, back in the queue: its reopening is not news to its reader

    @property
    def row_id(self) -> int:
        return self.spec.row_id

    @property
    def positions(self) -> int:
        """The KV positions it holds once its next token is in: its prompt and what it generated."""
        return len(self.spec.prompt) + len(self.generated)

    @property
    def width(self) -> int:
        """Batch slots it takes once admitted: a leader's whole family comes with it, the choices
        still on their way included (admission counted them when it admitted the leader)."""
        return self.family.count if self.family is not None else 1


@attrs.define(eq=False)
class Family:
    """The choices of one request (OpenAI's `n`) until they fork: the leader (choice 0) is queued
    and admitted only once its siblings have all arrived; they wait here, outside the queue, until
    it has prefilled, then are opened from its KV (`fork`) and join after it."""

    key: int
    count: int  # choices expected, the leader included (a follower that leaves lowers it)
    followers: list[Row] = attrs.Factory(list)

    @property
    def complete(self) -> bool:
        return 1 + len(self.followers) >= self.count


def rows_enqueued(siblings: Siblings | None) -> int:
    """The rows one `Enqueue` adds to the table's count (`RowTable.queued_rows`): a leader its
    whole family (`Row.width`), a later choice none (its leader's count has it), a lone row one.
    Admission counts each request's rows by this the moment it admits it, before its other
    choices are even submitted, so requests arriving together see each other's every row."""
    if siblings is None or siblings.count <= 1:
        return 1
    return siblings.count if siblings.index == 0 else 0


class RowTable:
    """Which rows are queued, which one is joining, which are running, and who may go next.

    Admission is strictly FIFO over one queue shared by both lanes (no reordering):
    * only the queue head is ever considered, and only when no joiner is mid-prefill;
    * a batched head joins while fewer than `capacity` rows run and no serial row runs;
    * a serial head waits until nothing runs and nothing prefills (the drain), then runs alone;
      everything behind it waits, so batch rows that arrived later never overtake it.
    FIFO makes both starvation properties structural: a serial row waits only for rows that
    arrived before it, and batch rows behind a serial row wait for that one row only.

    Group prefill (`admit_group`): batched rows at the head of the queue may be admitted
    together — opened and prefilled in one forward — and wait in `staged` until they join the
    batch together (`staged_ready`); one the group could not prefill becomes the joiner
    (`promote`). Nothing else is admitted until they have all joined.

    Siblings (`enqueue_sibling`): a request's choices share one prefill. The leader alone is queued
    and takes the batch slots of the whole family; after its prefill `fork` stages the others
    (they join as a group prefill's rows do), those whose KV fits the live-KV budget beside the
    active rows: the rest wait at the head of the queue, each to open alone. A leader that leaves
    before forking puts its followers in the queue where it stood, each to prefill alone.
    """

    def __init__(self, capacity: int, memory: KvBudget | None = None) -> None:
        self.capacity = max(1, capacity)
        self.memory = memory  # None: rows are bounded by `capacity` alone
        self.queue: deque[Row] = deque()
        self.joiner: Row | None = None
        self.staged: list[Row] = []  # admitted together (group prefill), waiting to join
        self.running: dict[int, Row] = {}
        self.families: dict[int, Family] = {}  # by Siblings.key, until the leader forks or leaves
        self._seq = 0

    # -- arrivals and departures

    def enqueue(self, row: Row) -> None:
        self._seq += 1
        row.seq = self._seq
        row.phase = "queued"
        self.queue.append(row)

    def enqueue_sibling(self, row: Row, siblings: Siblings) -> None:
        """Choice 0 is queued as its family's leader; a later choice waits attached to it, or is
        queued alone when the leader has already forked or left."""
        family = self.families.get(siblings.key)
        if siblings.index == 0 and siblings.count > 1 and family is None:
            row.family = self.families[siblings.key] = Family(siblings.key, siblings.count)
            self.enqueue(row)
        elif siblings.index > 0 and family is not None:
            self._seq += 1
            row.seq, row.phase = self._seq, "queued"
            family.followers.append(row)
        else:
            self.enqueue(row)

    def fork(self, leader: Row) -> list[Row]:
        """The joiner, prefilled, forks: its followers are staged, to be opened from its KV."""
        assert leader is self.joiner, "fork() of a row that is not the joiner"
        family, leader.family = leader.family, None
        if family is None:
            return []
        self.families.pop(family.key, None)
        forked: list[Row] = []
        for row in family.followers:  # (with a live-KV budget: those that fit beside the active rows)
            if not self.has_room_for([row]):
                break
            row.phase = "joining"
            self.staged.append(row)
            forked.append(row)
        for row in reversed(family.followers[len(forked) :]):  # the rest wait where it stood, each alone
            self.queue.appendleft(row)
        return forked

    def _disband(self, leader: Row, at: int) -> None:
        """A leader left before forking: its followers take its place in the queue."""
        family, leader.family = leader.family, None
        if family is None:
            return
        self.families.pop(family.key, None)
        for row in reversed(family.followers):
            self.queue.insert(at, row)

    def mark_leaving(self, row_id: int, reason: LeaveReason) -> Row | None:
        """A queued row leaves at once (returned, already out of the table); an active row is
        marked and leaves at the next boundary via `take_leavers`."""
        for at, row in enumerate(self.queue):
            if row.row_id == row_id:
                del self.queue[at]
                row.leaving = row.leaving or reason
                self._disband(row, at)
                return row
        for family in self.families.values():
            for row in family.followers:
                if row.row_id == row_id:
                    family.followers.remove(row)
                    family.count -= 1
                    row.leaving = row.leaving or reason
                    return row
        active = self.active(row_id)
        if active is not None and active.leaving is None:
            active.leaving = reason
        return None

    def take_leavers(self) -> list[Row]:
        leavers = [r for r in self._active_rows() if r.leaving is not None]
        for row in leavers:
            if row is self.joiner:
                self.joiner = None
                self._disband(row, 0)
            if row in self.staged:
                self.staged.remove(row)
            self.running.pop(row.row_id, None)
        return leavers

    # -- admission

    def admissible_head(self) -> Row | None:
        if self.joiner is not None or self.staged or not self.queue:
            return None
        head = self.queue[0]
        if self.serial_running or (head.family is not None and not head.family.complete):
            return None  # (a leader waits for its siblings: they are on their way)
        if head.lane == "serial":
            return head if not self.running else None
        if len(self.running) + min(head.width, self.capacity) > self.capacity:
            return None
        return head if self.has_room_for([head]) else None

    # -- the live-KV budget

    def has_room_for(self, rows: Sequence[Row]) -> bool:
        """`rows` may open beside the active ones: all of them, billed as the one batch they will
        be (`KvBudget.rows_bytes`), still fit the budget after each grows by `GROWTH_TOKENS` (a queued leader with
        room for its whole family, which forks from it). A lone row always may (admission bounded
        it by the whole budget)."""
        active = self._active_rows()
        if self.memory is None or (not active and len(rows) == 1):
            return True
        positions = [r.positions for r in active] + [r.positions for r in rows for _ in range(r.width)]
        return self.memory.rows_bytes([p + GROWTH_TOKENS for p in positions]) <= self.memory.budget_bytes

    def kv_bytes(self, rows: Sequence[Row] | None = None, growth: int = 0) -> int:
        """What `rows` (default: the active rows) hold as one batch, each grown by `growth`
        positions: a contiguous batch's rows are padded to its longest (model/kv/cache.py), paged
        ones hold their own blocks (`KvBudget.rows_bytes`). Each row opened holds one row of KV: a
        leader's other choices hold none until it forks them (`fork`), and those that do not fit
        then never open beside it."""
        if self.memory is None:
            return 0
        rows = self._active_rows() if rows is None else rows
        return self.memory.rows_bytes([r.positions + growth for r in rows])

    def preemption_victim(self, step_tokens: int) -> Row | None:
        """Before a decode step: when the active rows' next `step_tokens` positions would pass the
        budget, the running row that arrived last and may be preempted (the oldest work goes on);
        None while they fit, or with nothing else left running."""
        if self.memory is None or len(self._active_rows()) < 2:
            return None
        if self.kv_bytes(growth=step_tokens) <= self.memory.budget_bytes:
            return None
        candidates = [r for r in self.running.values() if r.preemptible and r.leaving is None]
        return max(candidates, key=lambda r: r.seq, default=None)

    def preempt(self, row: Row, resumed: RowSpec) -> None:
        """A running row goes back to the head of the queue, to resume as `resumed` (its prompt
        now ends with what it generated) ahead of every later arrival."""
        assert self.running.get(row.row_id) is row, "preempt() of a row that is not running"
        del self.running[row.row_id]
        row.spec, row.generated = resumed, []
        row.phase, row.opened, row.to_prefill = "queued", False, 0
        row.preemptions += 1
        row.resuming = True
        self.queue.appendleft(row)

    def admit(self, row: Row) -> None:
        """The admissible head becomes the joiner."""
        assert row is self.admissible_head(), "admit() of a row that is not the admissible head"
        self.queue.popleft()
        row.phase = "joining"
        self.joiner = row

    def admit_group(self, rows: Sequence[Row]) -> None:
        """The rows at the head of the queue leave it together, staged to prefill as one."""
        assert not self.staged and self.joiner is None, "admit_group() while rows are joining"
        for row in rows:
            assert self.queue[0] is row, "admit_group() of rows that are not the queue head"
            self.queue.popleft()
            row.phase = "joining"
        self.staged = list(rows)

    def promote(self, row: Row) -> None:
        """The first staged row becomes the joiner (it prefills alone)."""
        assert self.joiner is None and self.staged and self.staged[0] is row, "promote() out of turn"
        self.joiner = self.staged.pop(0)

    def staged_ready(self) -> list[Row]:
        """Staged rows with nothing left to prefill: they can join together."""
        return [r for r in self.staged if r.to_prefill == 0 and r.opened and r.leaving is None]

    def joined_staged(self, row: Row) -> None:
        self.staged.remove(row)
        row.phase = "running"
        self.running[row.row_id] = row

    def joined(self, row: Row) -> None:
        assert row is self.joiner
        self.joiner = None
        row.phase = "running"
        self.running[row.row_id] = row

    # -- views

    def active(self, row_id: int) -> Row | None:
        if self.joiner is not None and self.joiner.row_id == row_id:
            return self.joiner
        for row in self.staged:
            if row.row_id == row_id:
                return row
        return self.running.get(row_id)

    def rows(self) -> list[Row]:
        """Every row in the table: queued, waiting for a fork, staged, running, then the joiner."""
        followers = [row for family in self.families.values() for row in family.followers]
        rows = [*self.queue, *followers, *self.staged, *self.running.values()]
        if self.joiner is not None:
            rows.append(self.joiner)
        return rows

    def _active_rows(self) -> list[Row]:
        rows = list(self.running.values())
        if self.joiner is not None:
            rows.append(self.joiner)
        return rows + self.staged

    @property
    def queued_rows(self) -> int:
        """Rows not opened yet: the queue, a leader with every choice of its family."""
        return sum(row.width for row in self.queue)

    @property
    def active_rows(self) -> int:
        """Rows holding batch slots: running, staged, and the joiner with its choices (forked next)."""
        return sum(row.width for row in self._active_rows())

    @property
    def serial_running(self) -> bool:
        return any(r.lane == "serial" for r in self.running.values())

    @property
    def idle(self) -> bool:
        """Nothing to do until something arrives or leaves."""
        return not self.running and self.joiner is None and not self.staged and self.admissible_head() is None

    @property
    def draining(self) -> bool:
        """A serial row waits at the head for the batch to empty."""
        return bool(self.queue) and self.queue[0].lane == "serial" and bool(self._active_rows())
