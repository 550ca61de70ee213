"""The scheduler's decisions as plain function calls: a row table, the clock and the arrivals in,
the next action out. One table of situations; each row names the action `decide` must return.

Rows are written by id: `R(3, n=5)` is row 3 with a 5-token prompt (4 tokens to prefill when
opened for a group); actions come back as tuples of ids, e.g. `("Prefill", 3, 2)`.
"""

from __future__ import annotations

import math

import attrs
import pytest
import trio

from actors.messages import Lane, RowEvent
from actors.row_table import LeaveReason, Row, RowTable
from actors.scheduling import (
    Action,
    EndTurn,
    Hold,
    Join,
    JoinStaged,
    Open,
    OpenGroup,
    Prefill,
    Promote,
    Settings,
    Stage,
    Step,
    Turn,
    Wait,
    decide,
    hold_window,
    joined_in_burst,
)
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec

GROUPS = Settings(group_prefill_tokens=16)
HOLDS = Settings(group_prefill_tokens=16, arrival_window=0.5)
SMALL_CHUNKS = Settings(decoding_prefill_chunk=2)
NOW = 10.0


@attrs.frozen
class R:
    """A row of a situation."""

    id: int
    n: int = 4  # prompt tokens
    lane: Lane = "batched"
    to_prefill: int = 0
    opened: bool = True
    leaving: LeaveReason | None = None
    held_since: float | None = None


@attrs.frozen
class Situation:
    queue: tuple[R, ...] = ()
    staged: tuple[R, ...] = ()
    joiner: R | None = None
    running: tuple[R, ...] = ()
    capacity: int = 8


def build(s: Situation) -> RowTable:
    send, _ = trio.open_memory_channel[RowEvent](math.inf)

    def row(r: R) -> Row:
        spec = RowSpec(r.id, tuple(range(1, r.n + 1)), SamplingParams(), 8)
        return Row(
            spec=spec,
            lane=r.lane,
            out=send,
            to_prefill=r.to_prefill,
            opened=r.opened,
            leaving=r.leaving,
            held_since=r.held_since,
        )

    table = RowTable(s.capacity)
    for r in s.queue:
        table.enqueue(row(attrs.evolve(r, opened=False)))
    table.staged = [row(r) for r in s.staged]
    table.joiner = None if s.joiner is None else row(s.joiner)
    table.running = {r.id: row(r) for r in s.running}
    return table


def ids(value: object) -> object:
    if isinstance(value, Row):
        return value.row_id
    if isinstance(value, tuple):
        return tuple(ids(v) for v in value)
    return value


def described(action: Action) -> tuple[object, ...]:
    return (type(action).__name__, *(ids(v) for v in attrs.astuple(action, recurse=False)))


# (name, situation, settings, pending arrivals, turn, expected action)
CASES: list[tuple[str, Situation, Settings, int, Turn, tuple[object, ...]]] = [
    # -- idle
    ("empty: wait for a kick", Situation(), Settings(), 0, Turn(), ("Wait", None)),
    # -- the head alone
    ("a lone head opens", Situation(queue=(R(1),)), Settings(), 0, Turn(), ("Open", 1)),
    ("a lone head beside running rows", Situation(queue=(R(2),), running=(R(1),)), Settings(), 0, Turn(), ("Open", 2)),
    # -- the arrival hold
    ("lone head held for an arrival", Situation(queue=(R(1),)), HOLDS, 1, Turn(), ("Hold", 1, NOW, NOW + 0.5)),
    (
        "held since earlier: same deadline",
        Situation(queue=(R(1, held_since=9.8),)),
        HOLDS,
        1,
        Turn(),
        ("Hold", 1, 9.8, 9.8 + 0.5),
    ),
    ("deadline passed: it opens", Situation(queue=(R(1, held_since=9.5),)), HOLDS, 1, Turn(), ("Open", 1)),
    ("nothing on its way: no hold", Situation(queue=(R(1),)), HOLDS, 0, Turn(), ("Open", 1)),
    ("no window: no hold", Situation(queue=(R(1),)), GROUPS, 1, Turn(), ("Open", 1)),
    ("too wide to share a group: no hold", Situation(queue=(R(1, n=10),)), HOLDS, 1, Turn(), ("Open", 1)),
    ("a serial head is never held", Situation(queue=(R(1, lane="serial"),)), HOLDS, 1, Turn(), ("Open", 1)),
    ("a group with room is held", Situation(queue=(R(1), R(2))), HOLDS, 1, Turn(), ("Hold", 1, NOW, NOW + 0.5)),
    (
        "a group with no room for another row is not held",
        Situation(queue=(R(1, n=5), R(2, n=5), R(3, n=5), R(4, n=5))),
        HOLDS,
        1,
        Turn(),
        ("OpenGroup", (1, 2, 3, 4)),
    ),
    (
        "held: the running rows step meanwhile",
        Situation(queue=(R(2),), running=(R(1),)),
        HOLDS,
        1,
        Turn(held=NOW + 0.5),
        ("Step",),
    ),
    (
        "held, no call this turn: wait until the deadline",
        Situation(queue=(R(1),)),
        HOLDS,
        1,
        Turn(held=NOW + 0.5),
        ("Wait", NOW + 0.5),
    ),
    (
        "held, a call this turn: next turn",
        Situation(queue=(R(1),)),
        HOLDS,
        1,
        Turn(held=11.0, called=True),
        ("EndTurn", False),
    ),
    (
        "held at the head stage (after staged rows joined)",
        Situation(queue=(R(3),), running=(R(1), R(2))),
        HOLDS,
        1,
        Turn(stage=Stage.HEAD),
        ("Hold", 3, NOW, NOW + 0.5),
    ),
    # -- group prefill
    ("a burst opens one group", Situation(queue=(R(1), R(2), R(3))), GROUPS, 0, Turn(), ("OpenGroup", (1, 2, 3))),
    (
        "capacity bounds the group",
        Situation(queue=(R(2), R(3), R(4)), running=(R(1),), capacity=3),
        GROUPS,
        0,
        Turn(),
        ("OpenGroup", (2, 3)),
    ),
    (
        "the token budget bounds the group",
        Situation(queue=(R(1, n=7), R(2, n=7), R(3, n=7))),
        Settings(group_prefill_tokens=12),
        0,
        Turn(),
        ("OpenGroup", (1, 2)),
    ),
    (
        "a serial row ends the group",
        Situation(queue=(R(1), R(2), R(3, lane="serial"))),
        GROUPS,
        0,
        Turn(),
        ("OpenGroup", (1, 2)),
    ),
    ("group prefill off: the head opens alone", Situation(queue=(R(1), R(2))), Settings(), 0, Turn(), ("Open", 1)),
    (
        "past the group stage a groupable head waits for the next turn",
        Situation(queue=(R(1), R(2))),
        GROUPS,
        0,
        Turn(stage=Stage.STAGED),
        ("EndTurn", True),
    ),
    (
        "... and the running rows step meanwhile",
        Situation(queue=(R(2), R(3)), running=(R(1),)),
        GROUPS,
        0,
        Turn(stage=Stage.STAGED),
        ("Step",),
    ),
    # -- staged rows
    ("staged rows join together", Situation(staged=(R(1), R(2))), GROUPS, 0, Turn(), ("JoinStaged", (1, 2))),
    (
        "only the prefilled staged rows join",
        Situation(staged=(R(1, to_prefill=6), R(2), R(3))),
        GROUPS,
        0,
        Turn(),
        ("JoinStaged", (2, 3)),
    ),
    (
        "a leaving staged row does not join",
        Situation(staged=(R(1), R(2, leaving="abort"))),
        GROUPS,
        0,
        Turn(),
        ("JoinStaged", (1,)),
    ),
    (
        "staged rows wait for the joiner",
        Situation(staged=(R(2),), joiner=R(1, to_prefill=4)),
        GROUPS,
        0,
        Turn(),
        ("Prefill", 1, None),
    ),
    (
        "a staged row the group could not prefill is promoted",
        Situation(staged=(R(1, to_prefill=6), R(2, to_prefill=6))),
        GROUPS,
        0,
        Turn(),
        ("Promote", 1),
    ),
    (
        "promotion after the staged join",
        Situation(staged=(R(3, to_prefill=6),)),
        GROUPS,
        0,
        Turn(stage=Stage.PROMOTE),
        ("Promote", 3),
    ),
    (
        "nothing is admitted while a group's rows are joining",
        Situation(queue=(R(3),), staged=(R(2, to_prefill=4),), joiner=R(4, to_prefill=4)),
        GROUPS,
        0,
        Turn(),
        ("Prefill", 4, None),
    ),
    # -- the serial lane and capacity
    (
        "a serial head drains the batch",
        Situation(queue=(R(3, lane="serial"), R(4)), running=(R(1), R(2))),
        Settings(),
        0,
        Turn(),
        ("Step",),
    ),
    (
        "a serial head opens once nothing runs",
        Situation(queue=(R(3, lane="serial"),)),
        Settings(),
        0,
        Turn(),
        ("Open", 3),
    ),
    (
        "nothing joins a running serial row",
        Situation(queue=(R(2),), running=(R(1, lane="serial"),)),
        GROUPS,
        0,
        Turn(),
        ("Step",),
    ),
    ("capacity full", Situation(queue=(R(3),), running=(R(1), R(2)), capacity=2), Settings(), 0, Turn(), ("Step",)),
    # -- the joiner
    (
        "a joiner prefills alone in full chunks",
        Situation(joiner=R(1, to_prefill=8)),
        SMALL_CHUNKS,
        0,
        Turn(),
        ("Prefill", 1, None),
    ),
    (
        "beside decoding rows, in smaller chunks",
        Situation(joiner=R(2, to_prefill=8), running=(R(1),)),
        SMALL_CHUNKS,
        0,
        Turn(),
        ("Prefill", 2, 2),
    ),
    (
        "no smaller chunk configured",
        Situation(joiner=R(2, to_prefill=8), running=(R(1),)),
        Settings(),
        0,
        Turn(),
        ("Prefill", 2, None),
    ),
    ("prefilled, nothing running: a plain join", Situation(joiner=R(1)), Settings(), 0, Turn(), ("Join", 1, False)),
    (
        "into a running batch, nobody behind: it rides the next step",
        Situation(joiner=R(2), running=(R(1),)),
        Settings(),
        0,
        Turn(),
        ("Join", 2, True),
    ),
    (
        "rows queued behind: a plain join (a burst)",
        Situation(queue=(R(3),), joiner=R(2), running=(R(1),)),
        Settings(),
        0,
        Turn(),
        ("Join", 2, False),
    ),
    (
        "rows staged behind: a plain join",
        Situation(staged=(R(3, to_prefill=4),), joiner=R(2), running=(R(1),)),
        GROUPS,
        0,
        Turn(stage=Stage.JOINER),
        ("Join", 2, False),
    ),
    (
        "a leaving joiner gets no forward",
        Situation(joiner=R(2, leaving="abort", to_prefill=4), running=(R(1),)),
        Settings(),
        0,
        Turn(),
        ("Step",),
    ),
    # -- the step and the end of the turn
    ("running rows step", Situation(running=(R(1), R(2))), Settings(), 0, Turn(), ("Step",)),
    (
        "a burst skips the step",
        Situation(queue=(R(3),), running=(R(1),)),
        Settings(),
        0,
        Turn(stage=Stage.STEP, burst=True, called=True),
        ("EndTurn", False),
    ),
    (
        "after the step, straight on",
        Situation(running=(R(1),)),
        Settings(),
        0,
        Turn(stage=Stage.END, called=True),
        ("EndTurn", False),
    ),
    (
        "a turn without a call yields",
        Situation(joiner=R(2, leaving="abort")),
        Settings(),
        0,
        Turn(),
        ("EndTurn", True),
    ),
]


@pytest.mark.parametrize(
    ("situation", "settings", "pending", "turn", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide(
    situation: Situation, settings: Settings, pending: int, turn: Turn, expected: tuple[object, ...]
) -> None:
    table = build(situation)
    before = [(r.row_id, r.phase, r.leaving, r.to_prefill, r.held_since) for r in table.rows()]
    assert described(decide(table, NOW, pending, settings, turn)) == expected
    # Deciding changes nothing: the same question gets the same answer.
    assert [(r.row_id, r.phase, r.leaving, r.to_prefill, r.held_since) for r in table.rows()] == before
    assert described(decide(table, NOW, pending, settings, turn)) == expected


def test_each_action_moves_the_turn_on() -> None:
    table = build(Situation(queue=(R(1),), staged=(R(2),), running=(R(3),)))
    row = table.running[3]
    assert Turn().after(OpenGroup((row,)), called=True) == Turn(stage=Stage.STAGED, called=True)
    assert Turn().after(JoinStaged((row,)), called=True).stage == Stage.PROMOTE
    assert Turn().after(Promote(row), called=False) == Turn(stage=Stage.HEAD)
    assert Turn().after(Open(row), called=True).stage == Stage.JOINER
    assert Turn().after(Prefill(row, None), called=True).stage == Stage.STEP
    assert Turn().after(Join(row, riding=False), called=True, burst=True) == Turn(
        stage=Stage.STEP, burst=True, called=True
    )
    assert Turn().after(Step(), called=True).stage == Stage.END
    # A hold keeps the stage and is remembered for the rest of the turn (and its end).
    held = Turn(stage=Stage.HEAD).after(Hold(row, 1.0, 2.0), called=False)
    assert held == Turn(stage=Stage.HEAD, held=2.0)
    assert Turn(held=2.0).after(Open(row), called=True).held == 2.0
    for end in (Wait(None), EndTurn(checkpoint=True)):
        with pytest.raises(AssertionError):
            Turn().after(end, called=False)


def test_a_turn_walks_its_stages_in_order() -> None:
    """A whole turn, each action applied to the table as the scheduler would: a group is
    opened, joins, and the batch steps, and no stage runs twice."""
    table = build(Situation(queue=(R(1), R(2))))
    turn, seen = Turn(), []
    while True:
        action = decide(table, NOW, 0, GROUPS, turn)
        seen.append(described(action))
        match action:
            case OpenGroup(rows=rows):
                table.admit_group(rows)
                for r in rows:
                    r.opened, r.to_prefill = True, 0
            case JoinStaged(rows=rows):
                for r in rows:
                    table.joined_staged(r)
            case Step():
                pass
            case _:
                break
        turn = turn.after(action, called=True)
    assert seen == [("OpenGroup", (1, 2)), ("JoinStaged", (1, 2)), ("Step",), ("EndTurn", False)]


def test_the_hold_window_is_a_pure_function_of_when_the_head_was_first_held() -> None:
    table = build(Situation(queue=(R(1),)))
    assert hold_window(table, NOW, 1, HOLDS) == (NOW, NOW + 0.5)
    assert table.queue[0].held_since is None  # the scheduler records it, not the decision
    table.queue[0].held_since = NOW
    assert hold_window(table, NOW + 0.49, 1, HOLDS) == (NOW, NOW + 0.5)
    assert hold_window(table, NOW + 0.5, 1, HOLDS) is None
    table.joiner = table.queue.popleft()
    assert hold_window(table, NOW, 1, HOLDS) is None  # nothing admissible: nothing to hold


def test_a_join_with_rows_still_admissible_is_a_burst() -> None:
    assert joined_in_burst(build(Situation(queue=(R(2),), running=(R(1),))))
    assert joined_in_burst(build(Situation(staged=(R(2, to_prefill=4),), running=(R(1),))))
    assert not joined_in_burst(build(Situation(running=(R(1),))))
    assert not joined_in_burst(build(Situation(queue=(R(3),), running=(R(1), R(2)), capacity=2)))
