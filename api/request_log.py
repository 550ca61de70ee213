"""Per-request observation: one structured log line per HTTP request, and the record metrics read.

A request is observed without touching the route modules or the request actor:

* an outermost ASGI middleware opens a `RequestRecord` per HTTP request and puts it in a context
  variable (the route's task inherits it); it sees the status, the end of the body and a client
  disconnect, and adds an `X-Request-Id` header (the client's, when it sent a sane one);
* a tap on the request actor's ports (`handles.ports`: `Submit` to admission, `Abort` to the
  scheduler) and on each row's event channel sees the prompt size, the admission decision and
  lane, the queue exit (`RowOpened`, with its cached tokens), every `TokenOut` (TTFT, ITL), a
  failure, and an abort with the phase it cut (queued / prefill / decode);
* a tap on `handles.make_sink` sees the text pipeline's finish reason (`stop`, `length`,
  `tool_calls`), which is what the client was told.

The taps only observe: every call is forwarded unchanged, before anything is recorded, and a
submit made outside an HTTP request (no record in the context) passes through untouched.

The log line never carries prompt text unless `--log-prompts` is set; then the prompt is the
templated text the model saw (the tokenizer's decode of the prompt ids).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import attrs
import trio
from quart import request

from actors.messages import Abort, Admitted, Rejected, RowFailed, Submit
from model.rows import RowOpened, TokenOut

log = logging.getLogger("mlx_trio.requests")

QUIET_PATHS = frozenset({"/health", "/metrics"})  # scraped every few seconds: DEBUG when they succeed
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_EXTENSION_KEY = "mlx_trio.request_observer"

_current: ContextVar[RequestRecord | None] = ContextVar("mlx_trio_request_record", default=None)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being served in this task, if any."""
    return _current.get()


@attrs.define(eq=False)
class RequestRecord:
    """What one HTTP request did. Times are `trio.current_time()` seconds."""

    id: str
    method: str
    path: str
    client: str | None
    started: float
    observer: RequestObserver | None = None
    route: str | None = None  # the matched URL rule; None for an unmatched path
    status: int | None = None
    ended: float | None = None
    body_complete: bool = False
    client_disconnected: bool = False
    # generation (zero / None when the request generated nothing)
    prompt_ids: tuple[int, ...] | None = None
    prompt_tokens: int = 0
    submitted_at: float | None = None
    row_ids: list[int] = attrs.Factory(list)
    lane: str | None = None
    rejected: str | None = None  # the admission refusal's code (or status)
    admitted_at: float | None = None
    opened_at: float | None = None  # left the queue: the worker opened the row
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated_tokens: int = 0
    sink_finish_reason: str | None = None
    abort_phase: str | None = None  # queued | prefill | decode
    abort_cause: str | None = None  # client | cutoff (the shutdown deadline ended the stream)
    error: str | None = None

    # -- derived

    @property
    def generation(self) -> bool:
        return self.admitted_at is not None

    @property
    def client_abort(self) -> bool:
        """The client went away before the whole body was sent."""
        return self.client_disconnected and not self.body_complete

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

    # -- events from the taps

    def on_submit(self, prompt: tuple[int, ...]) -> None:
        self.prompt_ids = prompt if self.prompt_ids is None else self.prompt_ids + prompt
        self.prompt_tokens += len(prompt)
        if self.submitted_at is None:
            self.submitted_at = trio.current_time()

    def on_decision(self, decision: Any) -> None:
        if isinstance(decision, Admitted):
            self.row_ids.append(decision.row_id)
            self.lane = decision.lane
            if self.admitted_at is None:
                self.admitted_at = trio.current_time()
        elif isinstance(decision, Rejected):
            self.rejected = decision.code or str(decision.status)

    def on_row_event(self, event: Any) -> None:
        now = trio.current_time()
        if isinstance(event, RowOpened):
            self.cached_tokens += event.cached_tokens
            if self.opened_at is None:
                self.opened_at = now
        elif isinstance(event, TokenOut):
            self.generated_tokens += 1
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None and self.observer is not None:
                self.observer.token_interval(now - self.last_token_at)
            self.last_token_at = now
        elif isinstance(event, RowFailed):
            self.error = event.message

    def on_abort(self) -> None:
        if self.abort_phase is not None:
            return
        if self.opened_at is None:
            self.abort_phase = "queued"
        elif self.first_token_at is None:
            self.abort_phase = "prefill"
        else:
            self.abort_phase = "decode"
        # The request actor finishes its sink before aborting only when the shutdown deadline
        # cut the stream; a client that leaves never gets a finish.
        self.abort_cause = "cutoff" if self.sink_finish_reason is not None else "client"

    # -- the log line

    def fields(self, *, prompt_text: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "method": self.method,
            "route": self.route or self.path[:200],
            "status": self.status if self.status is not None else 500,
            "client": self.client,
            "duration_ms": _ms(self.duration),
        }
        if self.submitted_at is not None:
            out.update(
                lane=self.lane,
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
            if self.rejected is not None:
                out["rejected"] = self.rejected
            if self.abort_phase is not None:
                out["abort_phase"] = self.abort_phase
                out["abort_cause"] = self.abort_cause
            if self.error is not None:
                out["error"] = self.error
        out["client_abort"] = self.client_abort
        if prompt_text is not None:
            out["prompt"] = prompt_text
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# --- the taps on the request actor's boundary --------------------------------------------------


class _Forwarding:
    """Everything not overridden goes to the wrapped object."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> Any:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)


class _Tap:
    """Shared by every request on one `ServerHandles`; row id → record for `Abort`, which may be
    sent from a GC finalizer outside any request's context."""

    def __init__(self) -> None:
        self.rows: dict[int, RequestRecord] = {}


class _TappedSubmits(_Forwarding):
    def __init__(self, inner: Any, tap: _Tap) -> None:
        super().__init__(inner)
        self._tap = tap

    def send_nowait(self, submit: Any) -> None:
        record = _current.get()
        if record is not None and isinstance(submit, Submit):
            record.on_submit(submit.request.prompt)
            rows = _TappedRows(submit.rows, record, self._tap)
            submit = attrs.evolve(submit, reply=_TappedReply(submit.reply, record, self._tap, rows), rows=rows)
        self._inner.send_nowait(submit)


class _TappedReply(_Forwarding):
    def __init__(self, inner: Any, record: RequestRecord, tap: _Tap, rows: _TappedRows) -> None:
        super().__init__(inner)
        self._record, self._tap, self._rows = record, tap, rows

    def send_nowait(self, decision: Any) -> None:
        try:
            self._inner.send_nowait(decision)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if isinstance(decision, Admitted):  # the client left while admission decided
                self._record.abort_phase, self._record.abort_cause = "queued", "client"
            raise
        self._record.on_decision(decision)
        if isinstance(decision, Admitted):
            self._tap.rows[decision.row_id] = self._record
            self._rows.row_id = decision.row_id


class _TappedRows(_Forwarding):
    def __init__(self, inner: Any, record: RequestRecord, tap: _Tap) -> None:
        super().__init__(inner)
        self._record, self._tap = record, tap
        self.row_id: int | None = None  # set when admission admits the row

    def send_nowait(self, event: Any) -> None:
        self._inner.send_nowait(event)  # raises if the request actor is gone: nothing delivered
        self._record.on_row_event(event)

    def close(self) -> None:
        self._inner.close()
        if self.row_id is not None:  # the row is over: a late Abort cuts nothing
            self._tap.rows.pop(self.row_id, None)


class _TappedControl(_Forwarding):
    def __init__(self, inner: Any, tap: _Tap) -> None:
        super().__init__(inner)
        self._tap = tap

    def send_nowait(self, message: Any) -> None:
        if isinstance(message, Abort):
            record = self._tap.rows.pop(message.row_id, None)
            if record is not None:
                record.on_abort()
        self._inner.send_nowait(message)


class _TappedSink(_Forwarding):
    def __init__(self, inner: Any, record: RequestRecord) -> None:
        super().__init__(inner)
        self._record = record

    def finish(self, *, reason: str) -> list[Any]:
        events = self._inner.finish(reason=reason)
        # The request actor's own rule (actors/request.py `_finish`).
        self._record.sink_finish_reason = self._inner.finish_reason or ("stop" if reason == "eos" else reason)
        return events


def tap_handles(handles: Any) -> None:
    """Install the taps on `handles.ports` and `handles.make_sink`, once per handles (the taps
    are app-agnostic: they write to whichever record the current request carries)."""
    ports = handles.ports
    if isinstance(ports.submits, _TappedSubmits):
        return
    tap = _Tap()
    handles.ports = attrs.evolve(
        ports, submits=_TappedSubmits(ports.submits, tap), control=_TappedControl(ports.control, tap)
    )
    make_sink = handles.make_sink

    def tapped_make_sink(*args: Any, **kwargs: Any) -> Any:
        sink = make_sink(*args, **kwargs)
        record = _current.get()
        return sink if record is None else _TappedSink(sink, record)

    handles.make_sink = tapped_make_sink


# --- the middleware and the per-app observer ---------------------------------------------------


class RequestObserver:
    """One per app: opens a record per HTTP request and hands each finished one to listeners.

    `listeners` get the finished `RequestRecord` (synchronously; they must not block);
    `interval_listeners` get every inter-token interval as it happens (for the ITL histogram).
    """

    def __init__(self, app: Any) -> None:
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self.interval_listeners: list[Callable[[float], None]] = []
        self._app = app.asgi_app

    def token_interval(self, seconds: float) -> None:
        for listener in self.interval_listeners:
            listener(seconds)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        record = RequestRecord(
            id=_request_id(scope),
            method=scope.get("method", ""),
            path=scope.get("path", ""),
            client=(scope.get("client") or (None,))[0],
            started=trio.current_time(),
            observer=self,
        )

        async def observed_receive() -> Any:
            message = await receive()
            if message.get("type") == "http.disconnect":
                record.client_disconnected = True
            return message

        async def observed_send(message: Any) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                record.status = message.get("status")
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", record.id.encode()))
                message = {**message, "headers": headers}
            if kind == "http.response.body" and not message.get("more_body", False):
                # Before the await: hypercorn delivers its end-of-cycle http.disconnect while the
                # final send is in flight, which is not a client abort.
                record.body_complete = True
            await send(message)

        token = _current.set(record)
        try:
            await self._app(scope, observed_receive, observed_send)
        finally:
            _current.reset(token)
            record.ended = trio.current_time()
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("request listener %r failed", listener)


def _request_id(scope: Any) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(text):
                return text
            break
    return f"req-{secrets.token_hex(8)}"


def request_observer(app: Any, handles: Any) -> RequestObserver:
    """The app's observer, created (middleware, taps, route hook) on first use."""
    observer = app.extensions.get(_EXTENSION_KEY)
    if observer is not None:
        return observer
    tap_handles(handles)
    observer = RequestObserver(app)
    app.asgi_app = observer
    app.extensions[_EXTENSION_KEY] = observer

    @app.after_request
    async def note_route(response: Any) -> Any:
        record = _current.get()
        if record is not None:
            rule = request.url_rule
            record.route = rule.rule if rule is not None else None
        return response

    return observer


# --- the log line --------------------------------------------------------------------------------


class RequestLog:
    """Writes one line per finished request to the `mlx_trio.requests` logger:
    `request {"id": ..., "route": ..., ...}` (JSON, so it greps and parses); the same fields
    ride along as `extra={"request": fields}` for a structured handler."""

    def __init__(self, *, tokenizer: Any = None, log_prompts: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_prompts = log_prompts

    def __call__(self, record: RequestRecord) -> None:
        quiet = record.path in QUIET_PATHS and (record.status or 500) < 400
        level = logging.DEBUG if quiet else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields = record.fields(prompt_text=self._prompt_text(record))
        log.log(level, "request %s", json.dumps(fields), extra={"request": fields})

    def _prompt_text(self, record: RequestRecord) -> str | None:
        if not self.log_prompts or record.prompt_ids is None:
            return None
        try:
            return self.tokenizer.decode(list(record.prompt_ids))
        except Exception:  # a tokenizer without decode: the ids, still never dropped silently
            return json.dumps(list(record.prompt_ids))


def install_request_log(app: Any, handles: Any, *, log_prompts: bool | None = None) -> RequestLog:
    """One log line per request; `log_prompts` defaults to `handles.config.log_prompts`."""
    if log_prompts is None:
        log_prompts = bool(getattr(handles.config, "log_prompts", False))
    request_log = RequestLog(tokenizer=getattr(handles, "tokenizer", None), log_prompts=log_prompts)
    request_observer(app, handles).listeners.append(request_log)
    return request_log
