"""The request actor: one completion's life, from admission to the last event of its stream.

Inbound:  its admission reply (`Admitted` | `Rejected`, buffer 1) and its own per-row channel
          (`RowOpened`, `TokenOut`, `RowFailed`; unbounded, filled by the scheduler).
Outbound: `Submit` to admission; `Abort` / `StopRow` to the scheduler's control inbox
          (unbounded, `send_nowait`, so they can be sent from a `finally` under cancellation).

`admit()` returns once the request's row has opened (for the choices of one request, once the
last one has): a request still queued has sent no response byte, so when the shutdown gate
closes it is refused with 503 + Retry-After (its protocol's error, before any header) instead
of answering 200 with an empty completion.

The HTTP handler owns one `RequestActor` and must `close()` it in a `finally`; closing is
synchronous and idempotent. A client disconnect cancels the handler (or its body generator);
`close()` then aborts the row wherever it is — queued, mid-prefill or decoding — and releases
every per-request resource. Tokens run through the text pipeline (`CompletionSink`) here, so
protocol encoders only ever see text events.

Observation: the actor takes the `RequestObserver` in `observing` when it is built (the HTTP
middleware sets it per request; elsewhere it is `NULL_OBSERVER`), hands it on in its `Submit`,
and tells it `submitted`, `aborted` and `finished` itself.
"""

from __future__ import annotations

import math
import weakref
from contextvars import ContextVar
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from actors.admission import Admission
from actors.messages import (
    NULL_OBSERVER,
    Abort,
    Admitted,
    Control,
    GenerationRequest,
    Lane,
    Rejected,
    RequestObserver,
    RowEvent,
    RowFailed,
    StopRow,
    Submit,
)
from model.engine.reasoning import ThinkTracker
from model.engine.rows import RowOpened, TokenOut

# A stream cut by the shutdown deadline ends with this finish_reason, vLLM's for a request the
# server ended: not "length", which would say the request's own max_tokens did. The Anthropic and
# Responses encoders turn it into their protocols' nearest (pause_turn; incomplete).
CUT_OFF_FINISH_REASON = "abort"

# How many already-waiting tokens one `next_events` call takes at most (a stream far behind still
# yields to the event loop every this many tokens).
MAX_TOKENS_PER_TURN = 64

# Who observes the requests built in this context: the HTTP middleware sets the request's record.
observing: ContextVar[RequestObserver] = ContextVar("mlx_trio_request_observer", default=NULL_OBSERVER)


# The text events a sink makes of tokens (the api's text pipeline events); opaque here.
EventT = TypeVar("EventT")


class Sink(Protocol[EventT]):
    """Turns token ids into text events (`api.pipeline.sink.CompletionSink`)."""

    stopped: bool
    finish_reason: str | None

    def push(self, token_id: int) -> list[EventT]: ...

    def finish(self, *, reason: str) -> list[EventT]: ...


@attrs.frozen(eq=False)
class RequestPorts:
    """What a request actor talks to."""

    submits: trio.MemorySendChannel[Submit]
    control: trio.MemorySendChannel[Control]
    admission: Admission
    speculation: bool = False  # the server verifies drafts: usage reports them


class RequestRejected(Exception):
    def __init__(self, rejection: Rejected) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class GenerationFailed(Exception):
    """The row failed: the worker's failure (`status` 500), or the request's own output
    constraint failing mid-generation (400). Before the stream starts the route answers with
    `status`; after, with its protocol's error frame."""

    def __init__(self, message: str, *, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class _Release:
    """The synchronous end of a request, shared by `close()` and a GC finalizer.

    The finalizer covers a body generator that was never started (a disconnect between the
    handler returning and the body being iterated): Python runs no `finally` for it.
    """

    def __init__(
        self, ports: RequestPorts, rows: trio.MemoryReceiveChannel[RowEvent], observer: RequestObserver
    ) -> None:
        self.ports = ports
        self.rows = rows
        self.observer = observer
        self.row_id: int | None = None
        self.row_over = False  # the scheduler ends the row by itself: no Abort owed
        self.released = False

    def tell(self, message: Control) -> None:
        try:
            self.ports.control.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the scheduler is gone (shutdown): nothing left to stop

    def __call__(self) -> None:
        if self.released:
            return
        self.released = True
        if self.row_id is not None and not self.row_over:
            self.observer.aborted()
            self.tell(Abort(self.row_id))
        self.rows.close()
        if self.row_id is not None:
            self.ports.admission.request_ended()


class RequestActor(Generic[EventT]):
    def __init__(self, ports: RequestPorts, request: GenerationRequest, sink: Sink[EventT]) -> None:
        self.request = request
        self._ports = ports
        self._sink = sink
        self._observer = observing.get()
        rows_send, rows_recv = trio.open_memory_channel[RowEvent](math.inf)
        self._rows_send: trio.MemorySendChannel[RowEvent] | None = rows_send
        self._rows = rows_recv
        self._release = _Release(ports, rows_recv, self._observer)
        token = trio.lowlevel.current_trio_token()
        # run_sync_soon: a finalizer may fire anywhere, even inside trio's own bookkeeping.
        self._finalizer = weakref.finalize(self, _release_soon, token, self._release)
        self._finalizer.atexit = False
        self.admitted: Admitted | None = None
        self.cached_tokens = 0
        self.cache_created_tokens = 0  # prompt tokens the row puts at its retention hints
        self.completion_tokens = 0
        # A reasoning row's tokens followed as the engine follows them (model/engine/reasoning.py):
        # the ones inside its reasoning are `reasoning_tokens` (usage's completion_tokens_details).
        think = request.sampling.think
        self._think = None if think is None else ThinkTracker.start(think)
        self.reasoning_tokens = 0
        # Speculative decoding: the draft tokens the row's verifications checked, and accepted.
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        # Every TokenOut that carried logprobs (the row asked for them), EOS included: the
        # OpenAI routes build mlx-lm's `choices[0].logprobs` block from these.
        self.token_logprobs: list[TokenOut] = []
        self.finish_reason: str | None = None
        self.cut_off = False  # ended by the shutdown deadline
        self._done = False
        self._failure: GenerationFailed | None = None  # a failure met while taking waiting tokens
        self._early: list[RowEvent | None] = []  # an event `admit` received that is not RowOpened

    @property
    def lane(self) -> Lane | None:
        return self.admitted.lane if self.admitted else None

    async def admit(self) -> Admitted:
        """Admission's answer, then the wait for the row to open (the queue). Raises
        `RequestRejected`: 400 / 503 from admission, or 503 when the server began shutting down
        while the row was still queued."""
        rows = self._rows_send
        if rows is None:
            raise RuntimeError("a request actor is admitted once")
        reply_send, reply_recv = trio.open_memory_channel[Admitted | Rejected](1)
        with reply_recv:
            self._observer.submitted(self.request.prompt)
            self._ports.submits.send_nowait(Submit(self.request, rows, reply_send, self._observer))
            self._rows_send = None  # the scheduler owns the send end from here on
            decision = await reply_recv.receive()
        if isinstance(decision, Rejected):
            self._release.row_over = True
            self.close()
            raise RequestRejected(decision)
        self.admitted = decision
        self._release.row_id = decision.row_id
        self._ports.admission.request_started()
        siblings = self.request.siblings
        # The choices of one request open together (the leader, held until its siblings have all
        # arrived, then the rest from its KV): only the last one admitted waits for the opening.
        if siblings is None or siblings.index == siblings.count - 1:
            await self._until_opened()
        return decision

    async def _until_opened(self) -> None:
        admission = self._ports.admission
        first: RowEvent | None = None
        with admission.queued_scope() as scope:
            first = await self._receive_any()
        if scope.cancelled_caught:  # the shutdown gate closed while the row was queued
            try:
                first = self._rows.receive_nowait()
            except trio.WouldBlock:  # still queued: nothing was answered yet, so refuse it
                rejection = admission.shut_out()
                self.close()  # aborts the queued row
                raise RequestRejected(rejection) from None
            except trio.EndOfChannel:
                self._release.row_over = True
                first = None
        if isinstance(first, RowOpened):
            self.cached_tokens, self.cache_created_tokens = first.cached_tokens, first.cache_created
        elif isinstance(first, RowFailed) and first.status < 500:  # the request's own mistake, before any byte
            self._release.row_over = True
            self.close()
            raise RequestRejected(Rejected(first.status, first.message, "invalid_request_error", "adapter_not_mounted"))
        else:  # a failure or the channel's end: `next_events` reports it as before
            self._early.append(first)

    async def _receive_any(self) -> RowEvent | None:
        try:
            return await self._rows.receive()
        except trio.EndOfChannel:
            self._release.row_over = True
            return None

    async def next_events(self) -> list[EventT] | None:
        """The text events of the next token(s); the last list carries the pipeline's tail;
        None once the completion is over. Raises `GenerationFailed`.

        Tokens that are already waiting (the stream fell behind the batch) are taken in the same
        call, up to `MAX_TOKENS_PER_TURN`, so a busy event loop pays the per-wake and per-write
        costs once per turn instead of once per token.
        """
        if self._done:
            return None
        if self._failure is not None:
            self._done = True
            raise self._failure
        events = None
        while events is None:
            events = self._take(await self._receive(), raise_failure=True)
        for _ in range(MAX_TOKENS_PER_TURN - 1):
            if self._done:
                break
            try:
                item = self._rows.receive_nowait()
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                self._release.row_over = True
                item = None
            more = self._take(item, raise_failure=False)
            if more:
                events.extend(more)
            if self._failure is not None:
                break
        return events

    def _take(self, item: RowEvent | None, *, raise_failure: bool) -> list[EventT] | None:
        """One row event's text events; None when it carried none (`RowOpened`)."""
        if item is None:  # shutdown cut-off, or the scheduler ended the row without a finish
            return self._finish("length")
        if isinstance(item, RowOpened):
            self.cached_tokens, self.cache_created_tokens = item.cached_tokens, item.cache_created
            return None
        if isinstance(item, RowFailed):
            self._failed(GenerationFailed(item.message, status=item.status), raise_failure=raise_failure)
            return None
        self.drafted_tokens += item.drafted
        self.accepted_tokens += item.accepted
        if item.finish == "error":  # the row's output constraint failed: its token is not shown
            self.completion_tokens += 1
            self._failed(
                GenerationFailed(item.error or "the output constraint failed", status=400), raise_failure=raise_failure
            )
            return None
        return self._on_token(item)

    def _failed(self, failure: GenerationFailed, *, raise_failure: bool) -> None:
        self._release.row_over = True
        if raise_failure:
            self._done = True
            raise failure
        self._failure = failure  # raised on the next call, after what came before it

    def _on_token(self, token: TokenOut) -> list[EventT]:
        self.completion_tokens += 1
        if token.logprob is not None or token.top_logprobs:
            self.token_logprobs.append(token)
        if self._think is not None and token.finish != "stop" and self._think.step(token.token):
            self.reasoning_tokens += 1
        if token.finish == "stop":  # EOS: its text is never shown
            self._release.row_over = True
            return self._finish("eos")
        events = self._sink.push(token.token)
        if self._sink.stopped:
            self._release.tell(StopRow(token.row_id))
            self._release.row_over = True
            return events + self._finish("stop")
        if token.finish == "length":
            self._release.row_over = True
            return events + self._finish("length")
        return events

    async def _receive(self) -> RowEvent | None:
        if self._early:
            return self._early.pop()
        if self._ports.admission.cutoff > trio.current_time():
            # The common case under load: the event is already here, so no cancel scope is
            # needed for the shutdown cut-off (entering one per token is measurable).
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                return self._rows.receive_nowait()
            except trio.WouldBlock:
                pass
            except trio.EndOfChannel:
                self._release.row_over = True
                return None
        item: RowEvent | None = None
        with self._ports.admission.cutoff_scope() as scope:
            try:
                item = await self._rows.receive()
            except trio.EndOfChannel:
                self._release.row_over = True
        if scope.cancelled_caught:
            self.cut_off = True
        return item

    def _finish(self, cause: str) -> list[EventT]:
        self._done = True
        events = self._sink.finish(reason=cause)
        self.finish_reason = self._sink.finish_reason or ("stop" if cause == "eos" else cause)
        if self.cut_off:
            self.finish_reason = CUT_OFF_FINISH_REASON
        self._observer.finished(self.finish_reason)  # before the Abort that follows: it tells a cut-off
        return events

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the completion, if one did (Anthropic's stop_sequence)."""
        value = getattr(self._sink, "matched_stop", None)
        return value if isinstance(value, str) else None

    def usage(self) -> dict[str, Any]:
        prompt = len(self.request.prompt)
        details: dict[str, int] = {"cached_tokens": self.cached_tokens}
        if self.cache_created_tokens:  # only a request with retention hints stores any
            details["cache_creation_tokens"] = self.cache_created_tokens
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": details,
            # "+spec": some of the row's tokens came from verified drafts.
            "lane": f"{self.lane}+spec" if self.lane and self.drafted_tokens else self.lane,
        }
        if self._think is not None:  # a reasoning row: how many of its tokens were reasoning
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        if self._ports.speculation:
            out["speculation"] = {"drafted": self.drafted_tokens, "accepted": self.accepted_tokens}
        return out

    def close(self) -> None:
        """Synchronous and idempotent: safe in a `finally` under cancellation."""
        if self._rows_send is not None:  # never submitted
            self._rows_send.close()
            self._rows_send = None
        self._finalizer.detach()
        self._release()


def _release_soon(token: trio.lowlevel.TrioToken, release: _Release) -> None:
    try:
        token.run_sync_soon(release)
    except trio.RunFinishedError:
        pass
