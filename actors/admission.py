"""The admission actor: who gets in, with how many tokens, on which lane — and until when.

Inbound:  `submits` — `Submit` from request actors (unbounded; the wait-queue bound is a policy
          decision answered with 503, not channel backpressure).
Outbound: `scheduler` — `Enqueue` for each admitted request (carrying the request's observer),
          `Abort` when its requester vanished before reading the reply; each `Submit.reply` —
          one `Admitted` or `Rejected`, then the request's observer is told what happened.

It also owns the shutdown gate: once `close()` runs, every new request is refused with 503 and
every in-flight request's waits are cut at the shutdown deadline, so its stream can end with a
proper final chunk instead of being cut by the HTTP server.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import attrs
import trio

from actors.messages import Abort, Admitted, Control, Enqueue, GenerationRequest, Rejected, Submit
from actors.policy import AdmissionCeiling, BatchMode, SeedSource, clamp_max_tokens, over_budget_message, place
from model.rows import RowSpec

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0


@attrs.define
class AdmissionCounters:
    admitted: int = 0
    rejected_budget: int = 0
    rejected_queue_full: int = 0
    rejected_shutdown: int = 0
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
        self._waiting = waiting
        self._scheduler = scheduler
        self._seeds = seeds or SeedSource()
        self._next_row_id = 0
        self.counters = AdmissionCounters()
        self.closed = False
        self.cutoff = math.inf  # trio time at which in-flight requests are cut
        self._cutoff_scopes: set[trio.CancelScope] = set()
        self.in_flight = 0

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
            )
            self._scheduler.send_nowait(
                Enqueue(spec=spec, lane=decision.lane, rows=submit.rows, observer=submit.observer)
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
            return Rejected(503, "server is shutting down", "server_error", "shutting_down", RETRY_AFTER_S)
        prompt_tokens = len(request.prompt)
        if prompt_tokens == 0:
            return Rejected(400, "prompt is empty", "invalid_request_error", "empty_prompt")
        max_tokens = clamp_max_tokens(prompt_tokens, request.max_tokens, self.ceiling.max_safe_context)
        if max_tokens is None:
            self.counters.rejected_budget += 1
            message = over_budget_message(prompt_tokens, self.ceiling.max_safe_context)
            return Rejected(400, message, "memory_admission", "context_over_budget")
        if self._waiting() >= self.max_queue:
            self.counters.rejected_queue_full += 1
            return Rejected(
                503,
                f"server busy: {self.max_queue} requests are already waiting; retry later",
                "server_error",
                "queue_full",
                RETRY_AFTER_S,
            )
        self.counters.admitted += 1
        self.counters.clamped += max_tokens < request.max_tokens
        self._next_row_id += 1
        seed = request.seed if request.seed is not None else self._seeds.next()
        lane = place(explicit_seed=request.explicit_seed, mode=self.mode)
        return Admitted(row_id=self._next_row_id, max_tokens=max_tokens, lane=lane, seed=seed)

    # -- the shutdown gate

    def close(self, *, cutoff_after: float) -> None:
        """Stop admitting; requests still running `cutoff_after` seconds from now are cut."""
        self.closed = True
        self.cutoff = trio.current_time() + cutoff_after
        for scope in self._cutoff_scopes:
            scope.deadline = min(scope.deadline, self.cutoff)

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
