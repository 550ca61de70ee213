"""Following a row's reasoning token by token: where it begins and ends, how many tokens it has
taken, and which token the engine must force next to end it (`ThinkControl`,
model/engine/params.py).

Phases: `before` (the row has not opened reasoning; its prompt did not end inside it), then
`reasoning` from the open marker (or from the start), `closing` while the close marker's forced
tail (the template's separator) is still to come, and `after`. Reasoning tokens are the ones
strictly between the markers: a budget of N lets N through, then forces the close marker and
the separator, and the row goes on to its answer. A natural close ends the reasoning too; the
separator is forced after it only for a row whose constraint waits for the answer
(`constrain_after`), so the grammar starts exactly where the template's answer does.

Plain Python, no MLX: the engine's sampler keeps one per row (model/engine/sampling.py), and the
request actor one more to count the reasoning tokens a reply reports (actors/request.py); both
see the same tokens, forced ones included, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from model.engine.params import ThinkControl


@attrs.define
class ThinkTracker:
    control: ThinkControl
    phase: str = "before"  # before | reasoning | closing | after
    count: int = 0  # reasoning tokens so far
    closed: int = 0  # tokens of the closing sequence (marker, separator) emitted
    seen: int = 0  # tokens observed: positions 0 .. seen - 1

    @classmethod
    def start(cls, control: ThinkControl, earlier: Iterable[int] = ()) -> ThinkTracker:
        """A row's tracker; `earlier`: tokens it generated before (a preempted row resumed)."""
        tracker = cls(control, phase="reasoning" if control.starts_in_reasoning else "before")
        for token in earlier:
            tracker.step(token)
        return tracker

    @property
    def sequence(self) -> tuple[int, ...]:
        """What ends the reasoning: the close marker, then the separator."""
        return (self.control.close_id, *self.control.separator)

    @property
    def done(self) -> bool:
        return self.phase == "after"

    def step(self, token: int) -> bool:
        """The row's next token; True when it is a reasoning token."""
        control = self.control
        if self.phase == "before":
            if token == control.open_id:
                self.phase = "reasoning"
            return False
        if self.phase == "reasoning":
            if token != control.close_id:
                self.count += 1
                return True
            cut = control.budget is not None and self.count >= control.budget
            self.closed = 1
            tail = control.separator and (cut or control.constrain_after)
            self.phase = "closing" if tail else "after"
            return False
        if self.phase == "closing":
            self.closed += 1
            if self.closed >= len(self.sequence):
                self.phase = "after"
        return False

    def finish(self) -> None:
        """No reasoning follows (a constrained row that did not open it at its first token)."""
        self.phase = "after"

    def observe(self, index: int, token: int) -> None:
        """The token at `index` is known; idempotent per index, in order."""
        if index < self.seen:
            return
        if index > self.seen:
            raise RuntimeError(f"reasoning tracker skipped tokens: expected position {self.seen}, got {index}")
        self.seen += 1
        self.step(token)

    def forced(self) -> int | None:
        """The token the next position must be, given every token before it: the close marker
        once the budget is spent, then the separator; None when the model chooses."""
        if self.phase == "closing":
            return self.sequence[self.closed]
        budget = self.control.budget
        if self.phase == "reasoning" and budget is not None and self.count >= budget:
            return self.control.close_id
        return None

    def may_force(self, unobserved: int) -> bool:
        """Whether a position `unobserved` tokens past the observed ones could be forced, whatever
        those tokens are: when it cannot, the engine need not read them before sampling there."""
        if self.phase == "closing":
            return True
        budget = self.control.budget
        if budget is None or self.phase == "after":
            return False
        if self.phase == "reasoning":
            return self.count + unobserved >= budget
        return unobserved >= 1 + budget  # (before: one of them would have to open the reasoning)

    def forced_along(self, tokens: list[int]) -> list[int]:
        """`tokens` (samples at the next positions, each as if the ones before were kept) with
        the forced ones put in: what the row would emit (a speculative step's verification)."""
        trial = attrs.evolve(self)
        out = []
        for token in tokens:
            forced = trial.forced()
            token = token if forced is None else forced
            out.append(token)
            trial.step(token)
        return out
