"""OpenTelemetry request traces: on when `--otlp-endpoint URL` or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` is set, exported over OTLP/HTTP (protobuf).

Off, this module imports nothing of OpenTelemetry and the server pays nothing: the request
monitor has no tracer, so a record never keeps a trace's extra times. On, api/observability/trace_spans.py (the
only module that imports OpenTelemetry) opens one span per HTTP request and builds its phase spans
from the request's record once it ends (docs/tracing.md has the tree and the attributes).

Both settings name the collector's base URL, as the standard variable does (`/v1/traces` is
appended unless the URL already ends with it); the flag wins. The packages are the optional
`[otel]` extra: with the flag and without them the server does not start (model/options/values.py `NeedsOtel`);
with only the variable (often set for a whole fleet) it logs a warning and serves untraced.
Spans leave in batches from the SDK's own thread; what is still queued at exit is flushed then.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from api.observability.request_log import request_monitor
from model.options.values import TRACING_INSTALL_HINT as INSTALL_HINT
from model.options.values import otel_installed

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from quart_trio import QuartTrio

    from actors.handles import ServerHandles
    from api.observability.trace_spans import SpanTracer

log = logging.getLogger(__name__)

# The OpenTelemetry standard's deployment setting (read here only, and only when no flag is set).
ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (kept when it already names it)."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def trace_endpoint(configured: str | None) -> str | None:
    """Where traces go: the flag's URL, else the standard variable's, else None (tracing off)."""
    endpoint = configured or os.environ.get(ENDPOINT_VARIABLE, "").strip() or None
    return None if endpoint is None else traces_url(endpoint)


def install_tracing(
    app: QuartTrio,
    handles: ServerHandles,
    *,
    exporter: SpanExporter | None = None,
    processor: SpanProcessor | None = None,
) -> SpanTracer | None:
    """Traces every HTTP request of `app` when tracing is configured, or when a test hands an
    `exporter` (spans exported one by one, as they end) or a `processor`; else None, importing
    nothing."""
    endpoint = trace_endpoint(handles.options.observability.otlp_endpoint)
    if endpoint is None and exporter is None and processor is None:
        return None
    if not otel_installed():  # only the variable can get here: the flag checks at start-up
        log.warning("%s is set but OpenTelemetry is not installed: no traces (%s)", ENDPOINT_VARIABLE, INSTALL_HINT)
        return None
    from api.model_names import model_name
    from api.observability.trace_spans import SpanTracer

    if processor is None:
        processor = _processor(endpoint, exporter)
    tracer = SpanTracer(processor, model=model_name(handles))
    monitor = request_monitor(app)
    monitor.tracer = tracer
    monitor.listeners.append(tracer)
    if endpoint is not None and exporter is None:
        log.info("tracing requests to %s", endpoint)
    return tracer


def _processor(endpoint: str | None, exporter: SpanExporter | None) -> SpanProcessor:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is not None:
        return SimpleSpanProcessor(exporter)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
