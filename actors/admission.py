"""The admission actor: who gets in, with how many tokens, on which lane — and until when.

Inbound:  `submits` — `Submit` from request actors (unbounded; the wait-queue bound is a policy
          decision answered with 503, not channel backpressure).
Outbound: `scheduler` — `Enqueue` for each admitted request (carrying the request's observer),
          `Abort` when its requester vanished before reading the reply; each `Submit.reply` —
          one `Admitted` or `Rejected`, then the request's observer is told what happened.

It also owns the shutdown gate: once `close()` runs, every new request is refused with 503, every
admitted request still queued (its row not opened yet, so no response byte went out) is refused
with the same 503 at once, and every started request's waits are cut at the shutdown deadline,
so its stream can end with a proper final chunk instead of being cut by the HTTP server.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import attrs
import trio

from actors.messages import Abort, Admitted, Control, Enqueue, GenerationRequest, Rejected, Submit
from actors.policy import AdmissionCeiling, BatchMode, SeedSource, fit_rows, over_budget_message, place
from actors.row_table import rows_enqueued
from model.engine.rows import RowSpec

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


@attrs.define
class AdmissionCounters:
    admitted: int = 0
    rejected_budget: int = 0
    rejected_queue_full: int = 0
    rejected_shutdown: int = 0
    shut_out_queued: int = 0  # admitted, still queued when the shutdown began: refused with 503
    clamped: int = 0


class Admission:
    def __init__(
        self,
        *,
        ceiling: AdmissionCeiling,
        mode: BatchMode,
        max_queue: int,
        waiting: Callable[[], int],
        scheduler: trio.MemorySendChannel[Control],
        seeds: SeedSource | None = None,
    ) -> None:
        self.ceiling = ceiling
        self.mode = mode
        self.max_queue = max_queue
        # The admitted rows that must wait for a slot (`policy.waiting_rows`), `enqueued` counted:
        # rows that start at once in a free slot are not queued, whatever the scheduler's queue
        # holds for a moment.
        self._waiting = waiting
        self._scheduler = scheduler
        self._seeds = seeds or SeedSource()
        self._next_row_id = 0
        # The rows admitted toward the scheduler (`rows_enqueued`: a request's `n` at its first
        # choice), for its count of rows on their way.
        self.enqueued = 0
        self.counters = AdmissionCounters()
        self.closed = False
        self.cutoff = math.inf  # trio time at which in-flight requests are cut
        self._cutoff_scopes: set[trio.CancelScope] = set()
        self._queued_scopes: set[trio.CancelScope] = set()
        self.in_flight = 0
        self._ended = trio.Event()  # set (and replaced) each time the last in-flight request ends
        # Admitted requests waiting for their row to open. Their routes still count themselves
        # as arrivals (actors/arrivals.py) though admission has answered them: the root
        # subtracts these, and `on_queued` nudges the scheduler when one is counted.
        self.queued = 0
        self.on_queued: Callable[[], None] = lambda: None
        # Told each time the last in-flight request ends (a model pool's idle clock: actors/pool.py).
        self.on_idle: Callable[[], None] = lambda: None

    @property
    def waiting_rows(self) -> int:
        """The rows `--max-queue` bounds now: admitted, beyond the free batch slots."""
        return self._waiting()

    async def run(
        self,
        submits: trio.MemoryReceiveChannel[Submit],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async for submit in submits:
            self.handle(submit)

    def handle(self, submit: Submit) -> None:
        decision = self.decide(submit.request)
        if isinstance(decision, Admitted):
            request = submit.request
            spec = RowSpec(
                row_id=decision.row_id,
                prompt=request.prompt,
                sampling=attrs.evolve(request.sampling, seed=decision.seed),
                max_tokens=decision.max_tokens,
                namespace=request.namespace,
                snapshot_at=request.snapshot_at,
                retain=request.retain,
                adapters=request.adapters,
                images=request.images,
            )
            self._scheduler.send_nowait(
                Enqueue(
                    spec=spec,
                    lane=decision.lane,
                    rows=submit.rows,
                    observer=submit.observer,
                    siblings=request.siblings,
                )
            )
        try:
            submit.reply.send_nowait(decision)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if isinstance(decision, Admitted):
                submit.observer.left_before_answer()
                self._scheduler.send_nowait(Abort(decision.row_id))
            return
        submit.observer.decided(decision)

    def decide(self, request: GenerationRequest) -> Admitted | Rejected:
        if self.closed:
            self.counters.rejected_shutdown += 1
            return shutting_down()
        prompt_tokens = len(request.prompt)
        if prompt_tokens == 0:
            return Rejected(400, "prompt is empty", "invalid_request_error", "empty_prompt")
        # Each of the request's `n` choices is its own row: the window bounds each one, the
        # memory budget their KV together (every choice gets the same answer).
        siblings = request.siblings
        choices = siblings.count if siblings is not None else 1
        fit = fit_rows(self.ceiling, prompt_tokens=prompt_tokens, max_tokens=request.max_tokens, rows=choices)
        if fit == "window":  # (the routes refuse this first, with the same code)
            window = self.ceiling.context_length
            message = f"prompt is too long: {prompt_tokens} tokens > {window - 1} maximum"
            return Rejected(400, message, "invalid_request_error", "context_length_exceeded")
        if fit == "memory":
            self.counters.rejected_budget += 1
            message = over_budget_message(prompt_tokens, self.ceiling.memory_context(choices), choices=choices)
            return Rejected(400, message, "memory_admission", "context_over_budget")
        max_tokens = fit
        # One request waits as one: its first choice meets the queue cap for all its rows, counted
        # as enqueued from here on (its other choices come later, behind other requests' first).
        rows = rows_enqueued(siblings)
        self.enqueued += rows
        if rows and self._waiting() > self.max_queue:
            self.enqueued -= rows
            self.counters.rejected_queue_full += 1
            return Rejected(
                503,
                f"server busy: the wait queue is full (at most {self.max_queue} rows wait for a free batch slot, "
                "one per choice); retry later",
                "server_error",
                "queue_full",
                RETRY_AFTER_S,
            )
        self.counters.admitted += 1
        self.counters.clamped += max_tokens < request.max_tokens
        self._next_row_id += 1
        seed = request.seed if request.seed is not None else self._seeds.next()
        lane = place(mode=self.mode)
        return Admitted(row_id=self._next_row_id, max_tokens=max_tokens, lane=lane, seed=seed)

    # -- the shutdown gate

    def close(self, *, cutoff_after: float) -> None:
        """Stop admitting; requests still running `cutoff_after` seconds from now are cut."""
        self.closed = True
        self.cutoff = trio.current_time() + cutoff_after
        for scope in self._cutoff_scopes:
            scope.deadline = min(scope.deadline, self.cutoff)
        for scope in self._queued_scopes:
            scope.cancel()

    @contextlib.contextmanager
    def queued_scope(self) -> Iterator[trio.CancelScope]:
        """Wrap an admitted request's wait for its row to open; `close()` cancels it (at once
        when the gate is already closed)."""
        with trio.CancelScope() as scope:
            if self.closed:
                scope.cancel()
            self._queued_scopes.add(scope)
            self.queued += 1
            self.on_queued()
            try:
                yield scope
            finally:
                self._queued_scopes.discard(scope)
                self.queued -= 1

    def shut_out(self) -> Rejected:
        """The answer for an admitted request whose row had not opened when the gate closed."""
        self.counters.shut_out_queued += 1
        return shutting_down()

    @contextlib.contextmanager
    def cutoff_scope(self) -> Iterator[trio.CancelScope]:
        """Wrap one wait of an in-flight request (never a `yield` of a body generator)."""
        with trio.CancelScope(deadline=self.cutoff) as scope:
            self._cutoff_scopes.add(scope)
            try:
                yield scope
            finally:
                self._cutoff_scopes.discard(scope)

    def request_started(self) -> None:
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._ended.set()
            self._ended = trio.Event()
            self.on_idle()

    async def wait_idle(self) -> None:
        """Until no admitted request is in flight (at once when none is)."""
        while self.in_flight > 0:
            await self._ended.wait()


def shutting_down() -> Rejected:
    """503 + Retry-After: this server is draining, another one (or this one, restarted) can serve."""
    return Rejected(503, "server is shutting down", "server_error", "shutting_down", RETRY_AFTER_S)
