"""Per-request observation: one structured log line per HTTP request, and the record metrics read.

A request is observed without touching the route modules:

* an outermost ASGI middleware (`RequestMonitor`) opens a `RequestRecord` per HTTP request and
  sets it as the request's observer (`actors.request.observing`; the route's task inherits it);
  it sees the status, the end of the body and a client disconnect, and adds an `X-Request-Id`
  header (the client's, when it sent a sane one); the client is the peer's address, or the one
  an allowed proxy forwarded (`--forwarded-allow-ips`, api/http/forwarded.py);
* the record is the `RequestObserver` the actors tell about the request (actors/messages.py):
  the request actor its submit, abort and the text pipeline's finish reason (`stop`, `length`,
  `tool_calls`: what the client was told); admission its decision and lane; the scheduler every
  row event it delivered (the queue exit `RowOpened` with its cached tokens, every `TokenOut`
  for TTFT and ITL, a failure) and the row's end. An abort is recorded with the phase it cut
  (queued / prefill / decode).

An HTTP request generates from one prompt: its choices (OpenAI `n`) each submit it, and share one
prefill, so its prompt and cached tokens are counted once (the log line adds `choices` when n > 1).

A request handled outside HTTP has no record: its actors tell `NULL_OBSERVER`.

With tracing on (api/observability/tracing.py), the monitor's tracer opens the request's span when the record
opens (its `traceparent` goes out on the response) and builds the phase spans from the finished
record; the record then also keeps each prefill forward and the template start (`note_templating`).

The log line never carries prompt text unless `--log-prompts` is set; then the prompt is the
templated text the model saw (the tokenizer's decode of the prompt ids).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import attrs
import trio
from quart import Response, request
from quart.typing import ASGIReceiveCallable, ASGISendCallable
from quart_trio import QuartTrio

from actors.messages import Admitted, Rejected, RowEvent, RowFailed
from actors.request import observing
from api.http.forwarded import TrustedProxies, scope_client_address
from model.engine.rows import RowOpened, TokenOut

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveEvent, ASGISendEvent, Scope

    from actors.handles import ServerHandles
    from model.text.tokenizer import ChatTokenizer

log = logging.getLogger("mlx_trio.requests")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response started
QUIET_PATHS = frozenset({"/health", "/metrics"})  # scraped every few seconds: DEBUG when they succeed
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_EXTENSION_KEY = "mlx_trio.request_monitor"

AsgiApp = Callable[["Scope", ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]


class RequestTrace(Protocol):
    """A traced request's open span (api/observability/tracing.py): the headers naming it on the response."""

    headers: list[tuple[bytes, bytes]]


class RequestTracer(Protocol):
    """Opens a record's trace as the request arrives (`Scope` for its `traceparent`); it also
    listens for the finished record, to end it."""

    def open(self, record: RequestRecord, scope: Scope) -> RequestTrace | None: ...


@attrs.define(eq=False)
class RequestRecord:
    """What one HTTP request did; the `RequestObserver` of the requests it makes. Times are
    `trio.current_time()` seconds."""

    id: str
    method: str
    path: str
    client: str | None
    started: float
    monitor: RequestMonitor | None = None  # told every inter-token interval
    route: str | None = None  # the matched URL rule; None for an unmatched path
    status: int | None = None
    ended: float | None = None
    body_complete: bool = False
    client_disconnected: bool = False
    # generation (zero / None when the request generated nothing)
    prompt_ids: tuple[int, ...] | None = None
    prompt_tokens: int = 0
    choices: int = 0  # submits of the prompt: one per choice
    submitted_at: float | None = None
    rows_open: int = 0  # admitted rows whose channel the scheduler has not closed yet
    lane: str | None = None
    rejected: str | None = None  # the admission refusal's code (or status)
    admitted_at: float | None = None
    opened_at: float | None = None  # left the queue: the worker opened the row
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified for its rows
    preemptions: int = 0  # times a row of it was preempted (the live-KV budget) and resumed later
    sink_finish_reason: str | None = None
    abort_phase: str | None = None  # queued | prefill | decode
    abort_cause: str | None = None  # client | cutoff (the shutdown deadline ended the stream)
    error: str | None = None
    ignored: tuple[str, ...] = ()  # request fields the server did not know and ignored (api/chat_request.py)
    model: str | None = None  # the model a model pool picked for it (api/model_names.py)
    tokenizer: ChatTokenizer | None = None  # that model's (--log-prompts decodes with it)
    # the trace's extra times (trio seconds); `prefills` is kept only when the request is traced
    trace: RequestTrace | None = None
    template_at: float | None = None  # the chat template / tokenizing began: parsing is over
    rejected_at: float | None = None
    aborted_at: float | None = None
    prefills: list[tuple[float, float, int, int, int]] | None = None  # start, end, done, left, rows

    # -- derived

    @property
    def generation(self) -> bool:
        return self.admitted_at is not None

    @property
    def client_abort(self) -> bool:
        """The client went away before the whole body was sent."""
        return self.client_disconnected and not self.body_complete

    @property
    def final_status(self) -> int:
        """The response's status; when none started, 499 if the client left first, else 500."""
        if self.status is not None:
            return self.status
        return CLIENT_CLOSED_REQUEST if self.client_disconnected else 500

    @property
    def finish_reason(self) -> str | None:
        if self.sink_finish_reason is not None:
            return self.sink_finish_reason
        if self.error is not None:
            return "error"
        if self.abort_phase is not None or (self.generation and self.client_abort):
            return "abort"
        return None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def queue_time(self) -> float | None:
        if self.admitted_at is None or self.opened_at is None:
            return None
        return self.opened_at - self.admitted_at

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    # -- the RequestObserver events (actors/messages.py)

    def submitted(self, prompt: tuple[int, ...]) -> None:
        self.choices += 1
        if self.prompt_ids is not None:
            return  # another choice of the request's one prompt
        self.prompt_ids = prompt
        self.prompt_tokens = len(prompt)
        self.submitted_at = trio.current_time()

    def decided(self, decision: Admitted | Rejected) -> None:
        if isinstance(decision, Admitted):
            self.rows_open += 1
            self.lane = decision.lane
            if self.admitted_at is None:
                self.admitted_at = trio.current_time()
        else:
            self.rejected = decision.code or str(decision.status)
            self.rejected_at = trio.current_time()

    def left_before_answer(self) -> None:
        self.abort_phase, self.abort_cause = "queued", "client"
        self.aborted_at = trio.current_time()

    def prefilled(self, started: float, done: int, remaining: int, rows: int) -> None:
        if self.trace is not None:
            if self.prefills is None:
                self.prefills = []
            self.prefills.append((started, trio.current_time(), done, remaining, rows))

    def row_event(self, event: RowEvent) -> None:
        now = trio.current_time()
        if isinstance(event, RowOpened):
            if self.opened_at is None:  # the first choice's opening; the others fork its prefill
                self.opened_at = now
                self.cached_tokens = event.cached_tokens
        elif isinstance(event, TokenOut):
            self.generated_tokens += 1
            self.drafted_tokens += event.drafted
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None and self.monitor is not None:
                self.monitor.token_interval(now - self.last_token_at)
            self.last_token_at = now
            if event.finish == "error":  # the row's output constraint failed
                self.error = event.error or "error"
        elif isinstance(event, RowFailed):
            self.error = event.message

    def row_ended(self) -> None:
        self.rows_open = max(0, self.rows_open - 1)

    def preempted(self) -> None:
        self.preemptions += 1

    def aborted(self) -> None:
        if self.rows_open == 0:  # the row already ended: the abort cut nothing
            return
        self.rows_open -= 1
        if self.abort_phase is not None:
            return
        self.aborted_at = trio.current_time()
        if self.opened_at is None:
            self.abort_phase = "queued"
        elif self.first_token_at is None:
            self.abort_phase = "prefill"
        else:
            self.abort_phase = "decode"
        # The request actor finishes its sink before aborting only when the shutdown deadline
        # cut the stream; a client that leaves never gets a finish.
        self.abort_cause = "cutoff" if self.sink_finish_reason is not None else "client"

    def finished(self, reason: str) -> None:
        self.sink_finish_reason = reason

    # -- the log line

    def fields(self, *, prompt_text: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "method": self.method,
            "route": self.route or self.path[:200],
            "status": self.final_status,
            "client": self.client,
            "duration_ms": _ms(self.duration),
        }
        if self.model is not None:
            out["model"] = self.model
        if self.submitted_at is not None:
            out.update(
                # "+spec": its rows' tokens came from draft verifications (speculative decoding)
                lane=f"{self.lane}+spec" if self.lane and self.drafted_tokens else self.lane,
                prompt_tokens=self.prompt_tokens,
                cached_tokens=self.cached_tokens,
                generated_tokens=self.generated_tokens,
                # ttft = arrive (read, template, tokenize, admit) + queue + prefill (+ delivery)
                arrive_ms=_ms(None if self.admitted_at is None else self.admitted_at - self.started),
                queue_ms=_ms(self.queue_time),
                prefill_ms=_ms(
                    None
                    if self.first_token_at is None or self.opened_at is None
                    else self.first_token_at - self.opened_at
                ),
                ttft_ms=_ms(self.ttft),
                finish_reason=self.finish_reason,
            )
            if self.choices > 1:
                out["choices"] = self.choices
            if self.rejected is not None:
                out["rejected"] = self.rejected
            if self.preemptions:
                out["preempted"] = self.preemptions
            if self.abort_phase is not None:
                out["abort_phase"] = self.abort_phase
                out["abort_cause"] = self.abort_cause
            if self.error is not None:
                out["error"] = self.error
        if self.ignored:
            out["ignored"] = list(self.ignored)
        out["client_abort"] = self.client_abort
        if prompt_text is not None:
            out["prompt"] = prompt_text
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# --- the middleware ------------------------------------------------------------------------------


class RequestMonitor:
    """One per app: opens a record per HTTP request and hands each finished one to listeners.

    `listeners` get the finished `RequestRecord` (synchronously; they must not block);
    `interval_listeners` get every inter-token interval as it happens (for the ITL histogram).
    """

    def __init__(self, app: AsgiApp) -> None:
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self.interval_listeners: list[Callable[[float], None]] = []
        self.tracer: RequestTracer | None = None  # api/observability/tracing.py, when tracing is on
        # Whose X-Forwarded-For / Forwarded name the client (--forwarded-allow-ips); none until set.
        self.proxies = TrustedProxies()
        self.id_header = b"x-request-id"  # --request-id-header, lowercased (ASGI header names are)
        self._app = app

    def token_interval(self, seconds: float) -> None:
        for listener in self.interval_listeners:
            listener(seconds)

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        record = RequestRecord(
            id=_request_id(scope, self.id_header),
            method=scope.get("method", ""),
            path=scope.get("path", ""),
            client=scope_client_address(
                (cast(dict[str, Any], scope).get("client") or (None,))[0], scope.get("headers", ()), self.proxies
            ),
            started=trio.current_time(),
            monitor=self,
        )
        if self.tracer is not None:
            record.trace = self.tracer.open(record, scope)

        async def observed_receive() -> ASGIReceiveEvent:
            message = await receive()
            if message.get("type") == "http.disconnect":
                record.client_disconnected = True
            return message

        async def observed_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == self.id_header for name, _ in headers):
                    headers.append((self.id_header, record.id.encode()))
                if record.trace is not None:
                    headers.extend(record.trace.headers)
                message = {**message, "headers": headers}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # Before the await: hypercorn delivers its end-of-cycle http.disconnect while the
                # final send is in flight, which is not a client abort.
                record.body_complete = True
            await send(message)

        token = observing.set(record)
        try:
            await self._app(scope, observed_receive, observed_send)
        finally:
            observing.reset(token)
            record.ended = trio.current_time()
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("request listener %r failed", listener)


def _request_id(scope: Scope, header: bytes) -> str:
    for name, value in cast(dict[str, Any], scope).get("headers", ()):
        if name.lower() == header:
            text = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(text):
                return text
            break
    return f"req-{secrets.token_hex(8)}"


def note_templating() -> None:
    """The request's chat template and tokenizing begin (where a trace's parse span ends)."""
    record = observing.get()
    if isinstance(record, RequestRecord) and record.template_at is None:
        record.template_at = trio.current_time()


def note_ignored(names: tuple[str, ...]) -> None:
    """The request carried fields the server does not know (logged with it, counted in /metrics)."""
    record = observing.get()
    if names and isinstance(record, RequestRecord):
        record.ignored = tuple(dict.fromkeys((*record.ignored, *names)))


def request_monitor(app: QuartTrio) -> RequestMonitor:
    """The app's monitor, created (middleware, route hook) on first use."""
    monitor = app.extensions.get(_EXTENSION_KEY)
    if isinstance(monitor, RequestMonitor):
        return monitor
    monitor = RequestMonitor(app.asgi_app)
    app.asgi_app = monitor  # type: ignore[method-assign]
    app.extensions[_EXTENSION_KEY] = monitor

    @app.after_request
    async def note_route(response: Response) -> Response:
        record = observing.get()
        if isinstance(record, RequestRecord):
            rule = request.url_rule
            record.route = rule.rule if rule is not None else None
        return response

    return monitor


# --- the log line --------------------------------------------------------------------------------


class RequestLog:
    """Writes one line per finished request to the `mlx_trio.requests` logger:
    `request {"id": ..., "route": ..., ...}` (JSON, so it greps and parses); the same fields
    ride along as `extra={"request": fields}` for a structured handler."""

    def __init__(self, *, tokenizer: ChatTokenizer | None = None, log_prompts: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_prompts = log_prompts

    def __call__(self, record: RequestRecord) -> None:
        quiet = record.path in QUIET_PATHS and record.final_status < 400
        level = logging.DEBUG if quiet else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields = record.fields(prompt_text=self._prompt_text(record))
        log.log(level, "request %s", json.dumps(fields), extra={"request": fields})

    def _prompt_text(self, record: RequestRecord) -> str | None:
        if not self.log_prompts or record.prompt_ids is None:
            return None
        try:
            tokenizer = record.tokenizer or self.tokenizer
            if tokenizer is not None:
                return tokenizer.decode(list(record.prompt_ids))
        except Exception:  # a tokenizer that cannot decode: the ids, still never dropped silently
            pass
        return json.dumps(list(record.prompt_ids))


def install_request_log(app: QuartTrio, handles: ServerHandles, *, log_prompts: bool | None = None) -> RequestLog:
    """One log line per request; `log_prompts` defaults to `--log-prompts`."""
    if log_prompts is None:
        log_prompts = handles.options.observability.log_prompts
    request_log = RequestLog(tokenizer=handles.tokenizer, log_prompts=log_prompts)
    monitor = request_monitor(app)
    monitor.proxies = TrustedProxies.parse(handles.options.access.forwarded_allow_ips)
    monitor.id_header = handles.options.observability.request_id_header.lower().encode("latin-1")
    monitor.listeners.append(request_log)
    return request_log
