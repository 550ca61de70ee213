"""A request's OpenTelemetry spans, built from its record (api/observability/request_log.py).

Imported only when tracing is on (api/observability/tracing.py): importing this module imports OpenTelemetry.

The request span opens when the HTTP request arrives (a child of the client's W3C `traceparent`,
else a new trace's root), so the response can name it in its own `traceparent`. Everything else
is known only once the request is over: the phase spans are made then, from the record's trio
times, with explicit start and end times. Trio time maps to wall-clock nanoseconds through the
pair (time.time_ns(), trio.current_time()) taken when the request span opens, so every phase sits
exactly where it happened relative to the request span (under a MockClock, where virtual time is).

    {METHOD} {route}          SERVER, the whole HTTP request (status, request id, tokens, finish)
    ├── parse                 body read, JSON parse and translation, up to the chat template
    ├── template              chat template and tokenizing, up to the submit to admission
    ├── queue                 admission's decision (event `admitted`) and the wait to be opened
    ├── prefill               opened (cached prefix restored) to the first token
    │   └── prefill chunk     one per prefill forward of the row (a group prefill: `rows` > 1)
    ├── decode                the first token to the last (or to the abort)
    └── stream close          the end of generation to the response's end
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from api.observability.request_log import QUIET_PATHS, RequestRecord

if TYPE_CHECKING:
    from hypercorn.typing import Scope

SERVICE_NAME = "mlx-trio"
_PROPAGATOR = TraceContextTextMapPropagator()
_INCOMING = frozenset({b"traceparent", b"tracestate"})
_AttrValue = str | bool | int | float | Sequence[str]


@attrs.define(eq=False)
class OpenTrace:
    """A request's open span and the clock pair that places its phases (a `RequestTrace`)."""

    span: Span
    epoch_ns: int  # time.time_ns() ...
    trio_at: float  # ... at this trio time
    headers: list[tuple[bytes, bytes]]

    def ns(self, t: float) -> int:
        return self.epoch_ns + round((t - self.trio_at) * 1e9)


class SpanTracer:
    """The monitor's `RequestTracer`: opens each request's span, and (as a listener of finished
    records) makes its phase spans and ends it."""

    def __init__(self, processor: SpanProcessor, *, model: str) -> None:
        self.provider = TracerProvider(resource=_resource())
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("mlx_trio")
        self.model = model

    def open(self, record: RequestRecord, scope: Scope) -> OpenTrace | None:
        if record.path in QUIET_PATHS:  # health checks and scrapes every few seconds: not traced
            return None
        carrier = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in cast(dict[str, Any], scope).get("headers", ())
            if name.lower() in _INCOMING
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        epoch_ns = time.time_ns()
        span = self.tracer.start_span(
            f"{record.method} {record.path[:200]}", context=parent, kind=SpanKind.SERVER, start_time=epoch_ns
        )
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in out.items()]
        return OpenTrace(span, epoch_ns, record.started, headers)

    def __call__(self, record: RequestRecord) -> None:
        opened = record.trace
        if not isinstance(opened, OpenTrace):
            return
        root = opened.span
        end = record.ended if record.ended is not None else record.started
        root.update_name(f"{record.method} {record.route or record.path[:200]}")
        root.set_attributes(self._request_attributes(record))
        if record.final_status >= 500:
            root.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {record.final_status}"))
        if record.template_at is not None or record.submitted_at is not None:
            _Phases(self.tracer, opened, record, end).emit()
        root.end(end_time=opened.ns(end))

    def _request_attributes(self, record: RequestRecord) -> dict[str, _AttrValue]:
        out: dict[str, _AttrValue] = {
            "http.request.method": record.method,
            "url.path": record.path[:200],
            "http.response.status_code": record.final_status,
            "mlx_trio.request.id": record.id,
        }
        if record.route is not None:
            out["http.route"] = record.route
        if record.client is not None:
            out["client.address"] = record.client
        if record.client_abort:
            out["mlx_trio.client_abort"] = True
        if record.submitted_at is None:
            return out
        out.update(
            {
                "gen_ai.request.model": self.model,
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "mlx_trio.usage.cached_tokens": record.cached_tokens,
                "gen_ai.usage.output_tokens": record.generated_tokens,
            }
        )
        optional: dict[str, _AttrValue | None] = {
            "mlx_trio.lane": record.lane,
            "gen_ai.response.finish_reasons": [record.finish_reason] if record.finish_reason else None,
            "mlx_trio.abort.phase": record.abort_phase,
            "mlx_trio.abort.cause": record.abort_cause,
            "mlx_trio.rejected": record.rejected,
            "mlx_trio.choices": record.choices if record.choices > 1 else None,
            "error.type": record.error,
        }
        out.update({key: value for key, value in optional.items() if value is not None})
        return out


@attrs.define
class _Phases:
    """The phase spans of one finished generation request, under its request span."""

    tracer: trace.Tracer
    opened: OpenTrace
    record: RequestRecord
    end: float

    def emit(self) -> None:
        r = self.record
        submitted = r.submitted_at
        parse_end = r.template_at if r.template_at is not None else submitted
        self._span("parse", r.started, parse_end)
        if r.template_at is not None:
            self._span("template", r.template_at, submitted, {"gen_ai.usage.input_tokens": r.prompt_tokens})
        if submitted is None:
            return
        queue_end = _first(r.opened_at, r.rejected_at, r.aborted_at)
        queued = self._cut("queued")
        if r.rejected is not None:
            queued["mlx_trio.rejected"] = r.rejected
        admitted = None if r.admitted_at is None else ("admitted", {"mlx_trio.lane": r.lane or ""}, r.admitted_at)
        self._span("queue", submitted, queue_end, queued, event=admitted)
        if r.opened_at is None:
            self._close(queue_end)
            return
        prefill_end = _first(r.first_token_at, r.aborted_at)
        attributes = {"gen_ai.usage.input_tokens": r.prompt_tokens, "mlx_trio.usage.cached_tokens": r.cached_tokens}
        prefill = self._span("prefill", r.opened_at, prefill_end, {**attributes, **self._cut("prefill")})
        for started, ended, done, remaining, rows in r.prefills or ():
            chunk = {
                "mlx_trio.prefill.done": done,
                "mlx_trio.prefill.remaining": remaining,
                "mlx_trio.prefill.rows": rows,
            }
            self._span("prefill chunk", started, ended, chunk, parent=prefill)
        if r.first_token_at is None:
            self._close(prefill_end)
            return
        decode_end = r.aborted_at if r.abort_phase == "decode" else _first(r.last_token_at, r.aborted_at)
        decoded: dict[str, _AttrValue] = {"gen_ai.usage.output_tokens": r.generated_tokens, **self._cut("decode")}
        if r.drafted_tokens:
            decoded["mlx_trio.drafted_tokens"] = r.drafted_tokens
        self._span("decode", r.first_token_at, decode_end, decoded)
        self._close(decode_end)

    def _cut(self, phase: str) -> dict[str, _AttrValue]:
        return {"mlx_trio.abort.phase": phase} if self.record.abort_phase == phase else {}

    def _close(self, generation_end: float | None) -> None:
        start = generation_end if generation_end is not None else self.end
        reason = self.record.finish_reason
        self._span("stream close", start, self.end, {"gen_ai.response.finish_reasons": [reason]} if reason else None)

    def _span(
        self,
        name: str,
        start: float,
        end: float | None,
        attributes: Mapping[str, _AttrValue] | None = None,
        *,
        parent: Span | None = None,
        event: tuple[str, Mapping[str, _AttrValue], float] | None = None,
    ) -> Span:
        """A finished span from `start` to `end` (the request's end when unknown), never before its start."""
        stop = self.end if end is None else end
        begin = min(start, stop)
        context: Context = trace.set_span_in_context(parent or self.opened.span)
        span = self.tracer.start_span(name, context=context, start_time=self.opened.ns(begin), attributes=attributes)
        if event is not None:
            span.add_event(event[0], event[1], timestamp=self.opened.ns(event[2]))
        span.end(end_time=self.opened.ns(stop))
        return span


def _resource() -> Resource:
    """The SDK's resource (from the standard service-name and resource settings, as it reads them),
    named `mlx-trio` when they name no service."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


def _first(*times: float | None) -> float | None:
    """The first of the times that is known (in the order given: the phase's regular end first)."""
    for t in times:
        if t is not None:
            return t
    return None
