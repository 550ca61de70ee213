"""Pure scheduling and admission policy: no trio, no I/O, no clocks except injected ones.

The actors (`admission.py`, `scheduler.py`) are thin loops around these decisions, so every rule
here can be tested as plain function calls.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import attrs

from actors.messages import Lane
from model.rows import RowSpec

BatchMode = Literal["off", "serial", "batch"]

# --- placement and seeds (spec §1.15) --------------------------------------------------------


def batch_mode(batch: int, *, batchable: bool) -> BatchMode:
    """`--batch 1` pins the strict serial executor; a model whose caches cannot batch is `serial`."""
    if batch <= 1:
        return "off"
    return "batch" if batchable else "serial"


def place(*, explicit_seed: bool, mode: BatchMode) -> Lane:
    """The mechanism is frozen per request from the request alone, never from current load.

    An explicit seed promises reproducibility, and only a row running alone is reproducible
    whatever else is running (per-row RNG streams are exact, left-pad reduction order is not).
    """
    if mode == "batch" and not explicit_seed:
        return "batched"
    return "serial"


_GOLDEN_32 = 0x9E3779B9  # odd, so the Weyl sequence visits every 32-bit value before repeating
_MASK_32 = 0xFFFFFFFF


class SeedSource:
    """Default seeds: wall-clock milliseconds XOR a golden-ratio Weyl counter.

    Batched rows key their RNG by (seed, step); two requests in the same millisecond sharing a
    seed would make identical prompts sample identical outputs. The Weyl term differs on every
    call, so equal timestamps can never give equal seeds. 32 bits so any RNG accepts it.
    """

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._weyl = 0

    def next(self) -> int:
        self._weyl = (self._weyl + _GOLDEN_32) & _MASK_32
        return (self._clock_ms() ^ self._weyl) & _MASK_32


# --- memory admission (spec §1.11) -----------------------------------------------------------

PREFILL_CHUNK_TOKENS = 2048
PREFILL_BYTES_PER_TOKEN = 550_000  # 0.55 MB per chunk token: activations of one 2048-token chunk
PREFILL_TRANSIENT_BYTES = PREFILL_CHUNK_TOKENS * PREFILL_BYTES_PER_TOKEN
DEFAULT_BUDGET_FRACTION = 0.75


def system_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def memory_budget_bytes(budget_gb: float | None, *, device_memory_bytes: int = 0) -> int:
    """`--memory-budget` is decimal GB; the default leaves a quarter of memory to everything else."""
    if budget_gb is not None:
        return int(budget_gb * 1e9)
    total = device_memory_bytes or system_memory_bytes()
    return int(total * DEFAULT_BUDGET_FRACTION)


@attrs.frozen
class AdmissionCeiling:
    memory_budget_bytes: int
    usable_bytes: int  # budget − weights − prefill transient (may be negative)
    weights_bytes: int
    max_safe_context: int


def admission_ceiling(
    *, budget_bytes: int, weights_bytes: int, kv_bytes_per_token: int, context_length: int
) -> AdmissionCeiling:
    usable = budget_bytes - weights_bytes - PREFILL_TRANSIENT_BYTES
    by_memory = usable // kv_bytes_per_token if kv_bytes_per_token > 0 else context_length
    return AdmissionCeiling(
        memory_budget_bytes=budget_bytes,
        usable_bytes=usable,
        weights_bytes=weights_bytes,
        max_safe_context=max(0, min(by_memory, context_length)),
    )


def over_budget_message(prompt_tokens: int, max_safe_context: int) -> str:
    return (
        f"prompt is {prompt_tokens} tokens but the memory budget caps safe context at "
        f"{max_safe_context} — no room to generate; shorten the prompt or raise --memory-budget"
    )


def clamp_max_tokens(prompt_tokens: int, requested: int, max_safe_context: int) -> int | None:
    """max_tokens is a ceiling, not a promise: clamp to the room left; None = no room at all."""
    available = max_safe_context - prompt_tokens
    if available < 1:
        return None
    return min(requested, available)


# A row opened for group prefill ignores a cached prefix shorter than this: re-computing a short
# prefix (a chat template's opening tokens, say) costs less than prefilling the row alone.
GROUP_MIN_CACHED_TOKENS = 256

# --- the scheduler's row table (spec §4) -----------------------------------------------------

Phase = Literal["queued", "joining", "running"]
LeaveReason = Literal["finish", "stop", "abort", "error"]


@attrs.define(eq=False)
class Row:
    spec: RowSpec
    lane: Lane
    out: Any  # the row's event channel; opaque here
    seq: int = 0  # arrival order
    phase: Phase = "queued"
    leaving: LeaveReason | None = None  # set once; the first reason wins
    to_prefill: int = 0
    opened: bool = False  # the worker holds state for it (close_row owed)
    enqueued_at: float = 0.0  # trio time it reached the scheduler
    held_since: float | None = None  # when the scheduler first held it at the head for arrivals

    @property
    def row_id(self) -> int:
        return self.spec.row_id


class RowTable:
    """Which rows are queued, which one is joining, which are running, and who may go next.

    Admission is strictly FIFO over one queue shared by both lanes (no reordering, spec §4 step 4):
    * only the queue head is ever considered, and only when no joiner is mid-prefill;
    * a batched head joins while fewer than `capacity` rows run and no serial row runs;
    * a serial head waits until nothing runs and nothing prefills (the drain), then runs alone;
      everything behind it waits, so batch rows that arrived later never overtake it.
    FIFO makes both starvation properties structural: a serial row waits only for rows that
    arrived before it, and batch rows behind a serial row wait for that one row only.

    Group prefill (`admit_group`): the batched rows at the head of the queue may be admitted
    together — opened and prefilled in one forward — and wait in `staged` until they join the
    batch together (`staged_ready`); one the group could not prefill becomes the joiner
    (`next_staged`). Nothing else is admitted until they have all joined.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.queue: deque[Row] = deque()
        self.joiner: Row | None = None
        self.staged: list[Row] = []  # admitted together (group prefill), waiting to join
        self.running: dict[int, Row] = {}
        self._seq = 0

    # -- arrivals and departures

    def enqueue(self, row: Row) -> None:
        self._seq += 1
        row.seq = self._seq
        row.phase = "queued"
        self.queue.append(row)

    def mark_leaving(self, row_id: int, reason: LeaveReason) -> Row | None:
        """A queued row leaves at once (returned, already out of the table); an active row is
        marked and leaves at the next boundary via `take_leavers`."""
        for row in self.queue:
            if row.row_id == row_id:
                self.queue.remove(row)
                row.leaving = row.leaving or reason
                return row
        row = self.active(row_id)
        if row is not None and row.leaving is None:
            row.leaving = reason
        return None

    def take_leavers(self) -> list[Row]:
        leavers = [r for r in self._active_rows() if r.leaving is not None]
        for row in leavers:
            if row is self.joiner:
                self.joiner = None
            if row in self.staged:
                self.staged.remove(row)
            self.running.pop(row.row_id, None)
        return leavers

    # -- the admission decision

    def admissible_head(self) -> Row | None:
        if self.joiner is not None or self.staged or not self.queue:
            return None
        head = self.queue[0]
        if any(r.lane == "serial" for r in self.running.values()):
            return None
        if head.lane == "serial":
            return head if not self.running else None
        return head if len(self.running) < self.capacity else None

    def admit(self) -> Row:
        row = self.admissible_head()
        assert row is not None, "admit() without an admissible head"
        self.queue.popleft()
        row.phase = "joining"
        self.joiner = row
        return row

    def group_at_head(self, max_tokens: int) -> list[Row]:
        """The run of batched rows at the queue head that `admit_group` would take now: it
        fits the capacity and a padded prefill of at most `max_tokens` (the widest prompt times
        the rows). Two rows at least, else none (a lone row takes the ordinary path)."""
        if self.joiner is not None or self.staged or any(r.lane == "serial" for r in self.running.values()):
            return []
        group: list[Row] = []
        width = 0
        for row in self.queue:
            n = len(row.spec.prompt) - 1
            wider = max(width, n)
            if (
                row.lane != "batched"
                or len(self.running) + len(group) >= self.capacity
                or not 0 < n <= max_tokens
                or wider * (len(group) + 1) > max_tokens
            ):
                break
            group.append(row)
            width = wider
        return group if len(group) >= 2 else []

    def group_has_room(self, max_tokens: int) -> bool:
        """The group the head would open now (or the lone head) could take one more row as wide
        as its widest: worth waiting for a request still on its way in."""
        if self.admissible_head() is None:
            return False
        group = self.group_at_head(max_tokens) or [self.queue[0]]
        if len(group) < len(self.queue) or any(r.lane != "batched" for r in group):
            return False  # the row behind the group could not join it: waiting buys nothing
        width = max(len(r.spec.prompt) - 1 for r in group)
        return 0 < width * (len(group) + 1) <= max_tokens and len(self.running) + len(group) < self.capacity

    def admit_group(self, max_tokens: int) -> list[Row]:
        """Admit `group_at_head`: its rows leave the queue and are staged to prefill together."""
        group = self.group_at_head(max_tokens)
        if not group:
            return []  # (and the rows staged already stay staged)
        for row in group:
            self.queue.popleft()
            row.phase = "joining"
        self.staged = group
        return list(group)

    def next_staged(self) -> Row | None:
        """The first staged row becomes the joiner (when none is joining)."""
        if self.joiner is None and self.staged:
            self.joiner = self.staged.pop(0)
        return self.joiner

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

    def _active_rows(self) -> list[Row]:
        rows = list(self.running.values())
        if self.joiner is not None:
            rows.append(self.joiner)
        return rows + self.staged

    @property
    def idle(self) -> bool:
        """Nothing to do until something arrives or leaves."""
        return not self.running and self.joiner is None and not self.staged and self.admissible_head() is None

    @property
    def draining(self) -> bool:
        """A serial row waits at the head for the batch to empty."""
        return bool(self.queue) and self.queue[0].lane == "serial" and bool(self._active_rows())
