"""What the scheduler does next: a pure function of the row table, the clock and the arrivals.

`decide` reads the table and returns one action; the scheduler (`actors/scheduler.py`) carries
it out — a worker call, a change to the table, or a wait — and asks again. Nothing here awaits,
reads a clock, does I/O or changes the table, so every rule is a plain function call in tests.

A turn of the scheduler loop passes these stages in order, each at most once; `Turn` says which
stage comes next and what the turn did so far:

  GROUP   nothing to do: wait for a kick. A head that could share a group prefill is held for
          requests still on their way in; else the rows at the head open a group prefill.
  STAGED  staged rows with nothing left to prefill join the batch together.
  PROMOTE the first staged row (one the group could not prefill) becomes the joiner.
  HEAD    the admissible head is opened alone, unless held or a group could open at the head
          (it waits for the next turn's group prefill).
  JOINER  one forward for the joiner: a prefill chunk, or its join. A prefilled joiner that leads
          sibling choices first forks its KV into them (a copy, no forward); they are staged
          and join after it.
  STEP    one decode step, unless a join this turn left more rows to admit (a burst: the next
          row joins before the batch steps). First, while the step's growth would pass the
          live-KV budget, the running row that arrived last is preempted (back to the queue head).
  END     a turn that made a worker call goes straight on to the next; one that made none
          waits for a kick while the head is held, else yields once.

Before each turn the scheduler drops rows whose reader is gone, and after every worker call it
closes the rows that left; those are not decisions and happen outside this module.
"""

from __future__ import annotations

import enum

import attrs

from actors.row_table import Row, RowTable

# A row opened for group prefill ignores a cached prefix shorter than this: re-computing a short
# prefix (a chat template's opening tokens, say) costs less than prefilling the row alone.
GROUP_MIN_CACHED_TOKENS = 256


@attrs.frozen
class Settings:
    # Group prefill: simultaneous short arrivals are prefilled together, up to this many
    # (padded) tokens per forward; 0 = off (every row prefills alone).
    group_prefill_tokens: int = 0
    # A joiner's prefill chunk while other rows are decoding (0 = the worker's full chunk).
    decoding_prefill_chunk: int = 0
    # How long a head that could share a group prefill waits for requests on their way in.
    arrival_window: float = 0.0
    # Positions a decode step may add to each row (1, or 1 + the draft with speculation): the
    # growth the live-KV budget must hold before the step runs.
    step_tokens: int = 1


# -- actions


@attrs.frozen
class Hold:
    """The queue head waits until `until` for requests on their way in (first held at `since`,
    which the scheduler records on the row)."""

    row: Row
    since: float
    until: float


@attrs.frozen
class OpenGroup:
    """Admit the rows at the queue head together: open each, then one prefill_group call."""

    rows: tuple[Row, ...]


@attrs.frozen
class JoinStaged:
    """Staged rows join the batch in one join_group call."""

    rows: tuple[Row, ...]


@attrs.frozen
class Promote:
    """The first staged row becomes the joiner."""

    row: Row


@attrs.frozen
class Open:
    """Admit the queue head alone: it becomes the joiner and is opened."""

    row: Row


@attrs.frozen
class Prefill:
    """One prefill chunk of the joiner, of at most `limit` tokens (None = the worker's chunk)."""

    row: Row
    limit: int | None


@attrs.frozen
class Fork:
    """The prefilled joiner's siblings are opened from its KV (they are staged, to join after it)."""

    row: Row


@attrs.frozen
class Join:
    """The joiner enters the batch: `riding` = through join_group, its token 0 coming with the
    next step; else through join, which gives its token 0 at once."""

    row: Row
    riding: bool


@attrs.frozen
class Preempt:
    """The running row that arrived last leaves the batch for the head of the queue: the next
    step's growth would pass the live-KV budget (its KV goes to the prompt cache to resume from)."""

    row: Row


@attrs.frozen
class Step:
    """One decode step over the running rows."""


@attrs.frozen
class Wait:
    """The turn ends: wait for a kick (an arrival, a leave, a settled arrival), at most until
    `until` (None = no limit)."""

    until: float | None


@attrs.frozen
class EndTurn:
    """The turn ends; `checkpoint` = yield first (the turn made no worker call)."""

    checkpoint: bool


Action = Hold | OpenGroup | JoinStaged | Promote | Open | Prefill | Fork | Join | Preempt | Step | Wait | EndTurn


# -- the turn


class Stage(enum.IntEnum):
    GROUP = 0
    STAGED = 1
    PROMOTE = 2
    HEAD = 3
    JOINER = 4
    STEP = 5
    END = 6


_STAGE_AFTER: dict[type, Stage] = {
    OpenGroup: Stage.STAGED,
    JoinStaged: Stage.PROMOTE,
    Promote: Stage.HEAD,
    Open: Stage.JOINER,
    Prefill: Stage.STEP,
    Fork: Stage.JOINER,  # a copy, not a forward: the join follows in the same turn
    Join: Stage.STEP,
    Preempt: Stage.STEP,  # (another may follow, until the step's growth fits)
    Step: Stage.END,
}


@attrs.frozen
class Turn:
    stage: Stage = Stage.GROUP  # the next stage to decide
    held: float | None = None  # the head is held until then (decided earlier this turn)
    burst: bool = False  # the joiner joined with more rows admissible behind it
    called: bool = False  # the turn made a worker call (close_row included)

    def after(self, action: Action, *, called: bool, burst: bool = False) -> Turn:
        """The turn once `action` was carried out; `burst` = after a `Join`, rows still to admit
        (`joined_in_burst`, read right after the join)."""
        if isinstance(action, Hold):
            # The stage stays: the decisions before the hold are remade on an unchanged table.
            return attrs.evolve(self, held=action.until, called=called)
        stage = _STAGE_AFTER.get(type(action))
        assert stage is not None, f"{action!r} ends the turn"
        return Turn(stage=stage, held=self.held, burst=burst, called=called)


# -- the decision


def decide(table: RowTable, now: float, pending_arrivals: int, settings: Settings, turn: Turn) -> Action:
    """The next action of the turn. `pending_arrivals`: requests on their way in, read by a
    generation route or already in the scheduler's inbox."""
    stage = turn.stage
    group_tokens = settings.group_prefill_tokens
    if stage <= Stage.GROUP:
        if table.idle:
            return Wait(until=None)
        if (hold := _hold(table, now, pending_arrivals, settings, turn)) is not None:
            return hold
        if turn.held is None and group_tokens and (group := group_at_head(table, group_tokens)):
            return OpenGroup(tuple(group))
    if stage <= Stage.STAGED and table.joiner is None and (ready := table.staged_ready()):
        return JoinStaged(tuple(ready))
    if stage <= Stage.PROMOTE and table.joiner is None and table.staged:
        return Promote(table.staged[0])
    if stage <= Stage.HEAD:
        if (hold := _hold(table, now, pending_arrivals, settings, turn)) is not None:
            return hold
        # A head that could open a group waits one step for the next turn's group prefill rather
        # than prefilling alone now (one group forward between two decode steps): it keeps a
        # queued burst from alternating between solo and group prefills.
        head = table.admissible_head()
        if head is not None and turn.held is None and not (group_tokens and group_at_head(table, group_tokens)):
            return Open(head)
    if stage <= Stage.JOINER and (joiner := table.joiner) is not None and joiner.leaving is None:
        # One forward per turn — a chunk, or the join — so a running stream never waits more
        # than one of them between its tokens.
        if joiner.to_prefill > 0:
            # A smaller chunk beside decoding rows bounds the gap between two of their tokens.
            return Prefill(joiner, limit=(settings.decoding_prefill_chunk if table.running else 0) or None)
        if joiner.family is not None:
            return Fork(joiner)
        # Into a running batch with nobody queued behind it, the join rides the next step: no
        # L=1 forward of its own for the running streams to wait for. The rows of a burst join
        # one by one, each getting its token 0 at once.
        return Join(joiner, riding=bool(table.running) and not table.queue and not table.staged)
    if stage <= Stage.STEP and table.running and not turn.burst:
        if (victim := table.preemption_victim(settings.step_tokens)) is not None:
            return Preempt(victim)
        return Step()
    if turn.called:
        # No checkpoint: after a step the next one is submitted at once, so the worker computes
        # it while the request actors handle this step's tokens.
        return EndTurn(checkpoint=False)
    if turn.held is not None:
        return Wait(until=turn.held)  # nothing to run until an arrival settles or the window closes
    return EndTurn(checkpoint=True)


def joined_in_burst(table: RowTable) -> bool:
    """Right after a join: simultaneous arrivals form one batch, so the next row is admitted
    before the batch steps."""
    return bool(table.staged) or table.admissible_head() is not None


def hold_window(table: RowTable, now: float, pending_arrivals: int, settings: Settings) -> tuple[float, float] | None:
    """(since, until): the admissible head — alone, or opening a group with room to spare —
    waits from `since` (when it was first held; now, the first time) until `until` for requests
    on their way in, so they share its group prefill. None = admit now."""
    group_tokens = settings.group_prefill_tokens
    if not (group_tokens and settings.arrival_window > 0) or table.joiner is not None:
        return None
    if not group_has_room(table, group_tokens) or pending_arrivals == 0:
        return None
    head = table.queue[0]
    since = head.held_since if head.held_since is not None else now
    until = since + settings.arrival_window
    return (since, until) if now < until else None


def _hold(table: RowTable, now: float, pending_arrivals: int, settings: Settings, turn: Turn) -> Hold | None:
    if turn.held is not None:
        return None  # held already this turn
    window = hold_window(table, now, pending_arrivals, settings)
    return None if window is None else Hold(table.queue[0], *window)


def group_at_head(table: RowTable, max_tokens: int) -> list[Row]:
    """The run of batched rows at the queue head that can open a group prefill now: it fits the
    capacity and a padded prefill of at most `max_tokens` (the widest prompt times the rows).
    Two rows at least, else none (a lone row takes the ordinary path)."""
    if table.joiner is not None or table.staged or table.serial_running:
        return []
    group: list[Row] = []
    width = 0
    for row in table.queue:
        n = len(row.spec.prompt) - 1
        wider = max(width, n)
        if (
            row.lane != "batched"
            or row.family is not None  # a leader prefills alone, then forks
            or row.resuming  # its whole prompt is cached: it must not give up that hit
            or not table.has_room_for([*group, row])
            or len(table.running) + len(group) >= table.capacity
            or not 0 < n <= max_tokens
            or wider * (len(group) + 1) > max_tokens
        ):
            break
        group.append(row)
        width = wider
    return group if len(group) >= 2 else []


def group_has_room(table: RowTable, max_tokens: int) -> bool:
    """The group the head would open now (or the lone head) could take one more row as wide as
    its widest: worth waiting for a request still on its way in."""
    if table.admissible_head() is None:
        return False
    group = group_at_head(table, max_tokens) or [table.queue[0]]
    if len(group) < len(table.queue) or any(r.lane != "batched" or r.family is not None for r in group):
        return False  # the row behind the group could not join it: waiting buys nothing
    width = max(len(r.spec.prompt) - 1 for r in group)
    return 0 < width * (len(group) + 1) <= max_tokens and len(table.running) + len(group) < table.capacity
