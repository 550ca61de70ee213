"""GET /metrics: Prometheus text format (prometheus-client), with vLLM's metric names.

Names mirror vLLM's `vllm:*` metrics under the `mlx_trio:` prefix, so dashboards port by a
prefix rename (`vllm:` → `mlx_trio:`); where vLLM has no equivalent the name says what it is.
Counters get prometheus-client's `_total` suffix (and `_created` series).

Observed per request (from `api.observability.request_log`'s records, or `Metrics.observe_request`):

| metric | type | vLLM name |
|---|---|---|
| `mlx_trio:requests_total{route,status,finish_reason}` | counter | (instrumentator's `http_requests_total`) |
| `mlx_trio:request_success_total{finished_reason}` | counter | `vllm:request_success_total` |
| `mlx_trio:prompt_tokens_total` / `generation_tokens_total` | counter | same |
| `mlx_trio:prefix_cache_queries_total` / `prefix_cache_hits_total` (tokens) | counter | same |
| `mlx_trio:time_to_first_token_seconds` | histogram | same |
| `mlx_trio:inter_token_latency_seconds` | histogram | same |
| `mlx_trio:e2e_request_latency_seconds` | histogram | same |
| `mlx_trio:request_queue_time_seconds` | histogram | same |
| `mlx_trio:request_prompt_tokens` / `request_generation_tokens` | histogram | same |
| `mlx_trio:request_aborts_total{phase,cause}` | counter | — (phase: queued / prefill / decode; |
| | | cause: client / cutoff) |
| `mlx_trio:ignored_fields_total{field}` | counter | — (request fields, block types and values the |
| | | server does not know and ignored; the first 64 names, then `other`) |

Read at scrape time from `handles.stats()` (a block that is absent, e.g. `ssd_cache` without an
SSD tier, simply yields no series):

| metric | source |
|---|---|
| `mlx_trio:num_requests_running` / `num_requests_waiting` (vLLM names) | `batch.active_rows` / scheduler waiting |
| `mlx_trio:num_requests_in_flight` | `admission.in_flight` |
| `mlx_trio:engine_healthy` | 1 unless /health would answer 503 |
| `mlx_trio:admission_rejections_total{reason}` | `admission.rejected_*` |
| `mlx_trio:scheduler_rows_total{outcome}`, `scheduler_steps_total`, `prefill_chunks_total` | `batch.*` counters |
| `mlx_trio:kv_cache_usage_perc` (vLLM name) | `batch.kv_bytes / batch.kv_budget_bytes`, when present |
| `mlx_trio:num_preemptions_total` (vLLM name), `num_resumptions_total`, `kv_cache_peak_bytes` | `batch.*` |
| `mlx_trio:prompt_cache_{hits,misses}_total`, `prompt_cache_{entries,bytes,max_bytes}` | `prompt_cache` |
| `mlx_trio:ssd_cache_{restores,spills,dropped_spills,failed_spills}_total` | `ssd_cache` |
| `mlx_trio:ssd_cache_{restore_failures,quarantined,demotions}_total` | `ssd_cache` |
| `mlx_trio:ssd_cache_{entries,bytes,max_bytes,pending_snapshots,pending_spills,pending_spill_bytes}` | `ssd_cache` |
| `mlx_trio:ssd_cache_{restore_ms_last,longest_durable_prefix_tokens}` | `ssd_cache` |
| `mlx_trio:spec_drafted_tokens_total` / `spec_accepted_tokens_total` | `speculation.drafted` / `.accepted` |
| `mlx_trio:responses_store_{entries,bytes,max_bytes}`, `responses_store_{evicted,refused}_total` | `responses_store` |

Each app has its own `CollectorRegistry` (never the process-global one), so tests can build many.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from quart import Response, request
from quart_trio import QuartTrio

from api.observability.health import health_problem
from api.observability.request_log import RequestRecord, request_monitor

if TYPE_CHECKING:
    from actors.handles import ServerHandles

log = logging.getLogger(__name__)

PREFIX = "mlx_trio:"
MAX_IGNORED_NAMES = 64  # distinct `field` labels of ignored_fields_total; later names count as "other"
_LABEL_SAFE = re.compile(r"[A-Za-z0-9_.\-]{1,80}")
_EXTENSION_KEY = "mlx_trio.metrics"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

UNMATCHED_ROUTE = "unmatched"  # unknown paths share one label value: a scanner cannot blow up cardinality
NO_FINISH = "none"


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_tokens` (vLLM's `build_1_2_5_buckets`)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_tokens:
                return tuple(out) or (1.0,)
            out.append(float(value))
        exponent += 1


class Metrics:
    """The app's metrics: per-request instruments plus a scrape-time collector over `stats`."""

    def __init__(
        self,
        *,
        stats: Callable[[], Mapping[str, Any]] | None = None,
        healthy: Callable[[], bool] | None = None,
        max_model_len: int = 131_072,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "HTTP requests by route, status and finish reason.",
            ["route", "status", "finish_reason"],
            registry=r,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished generation requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prompt cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prompt cache.", registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens of one request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last byte.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from admission until the worker opened the row.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt tokens per request.", buckets=buckets, registry=r
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens per request.", buckets=buckets, registry=r
        )
        self.aborts = Counter(
            PREFIX + "request_aborts",
            "Rows cut before their end, by the phase they were in and why.",
            ["phase", "cause"],
            registry=r,
        )
        self.ignored_fields = Counter(
            PREFIX + "ignored_fields",
            "Request fields, block types and values the server did not know and ignored.",
            ["field"],
            registry=r,
        )
        self._ignored_names: set[str] = set()  # label values seen: bounded, clients choose them
        if stats is not None:
            r.register(StatsCollector(stats, healthy=healthy))

    # -- the observer API the request path calls

    def observe_request(
        self,
        *,
        route: str | None,
        status: int,
        finish_reason: str | None = None,
        generation: bool = False,
        ttft: float | None = None,
        e2e: float | None = None,
        queue_time: float | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        generated_tokens: int = 0,
        abort_phase: str | None = None,
        abort_cause: str | None = None,
        itl: Iterable[float] = (),
    ) -> None:
        """One finished HTTP request. `generation`: it was admitted and ran on the engine (then
        its token counts and latencies are observed too). `itl` is for callers that did not feed
        `observe_itl` live."""
        self.requests.labels(route or UNMATCHED_ROUTE, str(status), finish_reason or NO_FINISH).inc()
        if abort_phase is not None:
            self.aborts.labels(abort_phase, abort_cause or "client").inc()
        for seconds in itl:
            self.itl.observe(seconds)
        if not generation:
            return
        if finish_reason is not None:
            self.request_success.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)

    def observe_ignored(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._ignored_names:
                if len(self._ignored_names) >= MAX_IGNORED_NAMES or not _LABEL_SAFE.fullmatch(name):
                    name = "other"
                self._ignored_names.add(name)
            self.ignored_fields.labels(name).inc()

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_record(self, record: RequestRecord) -> None:
        self.observe_ignored(record.ignored)
        self.observe_request(
            route=record.route,
            status=record.final_status,
            finish_reason=record.finish_reason,
            generation=record.generation,
            ttft=record.ttft,
            e2e=record.duration,
            queue_time=record.queue_time,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            generated_tokens=record.generated_tokens,
            abort_phase=record.abort_phase,
            abort_cause=record.abort_cause,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class StatsCollector:
    """Scrape-time series from a /stats-shaped dict; missing blocks and keys are skipped."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], *, healthy: Callable[[], bool] | None = None) -> None:
        self._stats = stats
        self._healthy = healthy

    def collect(self) -> Iterator[Metric]:
        if self._healthy is not None:
            yield _gauge("engine_healthy", "1 when /health answers 200, else 0.", 1.0 if self._healthy() else 0.0)
        try:
            stats = self._stats()
        except Exception:
            log.exception("metrics: stats() failed; scraping without its series")
            return
        yield from _batch_series(_block(stats, "batch"))
        yield from _admission_series(_block(stats, "admission"))
        yield from _prompt_cache_series(_block(stats, "prompt_cache"))
        yield from _ssd_series(_block(stats, "ssd_cache"))
        yield from _simple(_block(stats, "speculation"), _SPEC_SPECS)
        yield from _simple(_block(stats, "responses_store"), _RESPONSES_STORE_SPECS)


def _block(stats: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    block = stats.get(name)
    return block if isinstance(block, Mapping) else {}


def _number(block: Mapping[str, Any], key: str) -> float | None:
    value = block.get(key)
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def _gauge(name: str, doc: str, value: float) -> Metric:
    family = GaugeMetricFamily(PREFIX + name, doc)
    family.add_metric([], value)
    return family


def _counter(name: str, doc: str, value: float) -> Metric:
    family = CounterMetricFamily(PREFIX + name, doc)
    family.add_metric([], value)
    return family


def _simple(block: Mapping[str, Any], specs: Iterable[tuple[str, str, str, str]]) -> Iterator[Metric]:
    """specs: (metric name, kind "gauge"|"counter", stats key, help)."""
    for name, kind, key, doc in specs:
        value = _number(block, key)
        if value is not None:
            yield (_gauge if kind == "gauge" else _counter)(name, doc, value)


def _batch_series(batch: Mapping[str, Any]) -> Iterator[Metric]:
    yield from _simple(
        batch,
        [
            ("num_requests_running", "gauge", "active_rows", "Rows on the engine (running or joining)."),
            ("num_requests_waiting", "gauge", "pending_rows", "Rows admitted and waiting for the engine."),
            ("scheduler_steps", "counter", "steps", "Batched decode steps."),
            ("prefill_chunks", "counter", "prefill_chunks", "Prompt chunks prefilled."),
            ("num_preemptions", "counter", "preemptions", "Running rows preempted: the live-KV budget was full."),
            ("num_resumptions", "counter", "resumes", "Preempted rows opened again."),
            ("kv_cache_peak_bytes", "gauge", "peak_kv_bytes", "The most live KV the active rows held together."),
        ],
    )
    outcomes = [(o, _number(batch, f"{o}_rows")) for o in ("submitted", "finished", "stopped", "aborted", "failed")]
    if any(v is not None for _, v in outcomes):
        family = CounterMetricFamily(
            PREFIX + "scheduler_rows", "Rows by how the scheduler ended them.", labels=["outcome"]
        )
        for outcome, value in outcomes:
            if value is not None:
                family.add_metric([outcome], value)
        yield family
    used, budget = _number(batch, "kv_bytes"), _number(batch, "kv_budget_bytes")
    if used is not None and budget:
        yield _gauge("kv_cache_usage_perc", "KV cache usage, 0..1 of its budget.", used / budget)


def _admission_series(admission: Mapping[str, Any]) -> Iterator[Metric]:
    yield from _simple(
        admission,
        [
            ("num_requests_in_flight", "gauge", "in_flight", "Admitted requests not yet ended."),
            ("admission_accepting", "gauge", "accepting", "1 while admission accepts requests."),
            ("max_safe_context", "gauge", "max_safe_context", "Largest context the memory budget admits."),
            ("admitted_requests", "counter", "admitted", "Requests admitted."),
            ("clamped_requests", "counter", "clamped", "Requests whose max_tokens the budget clamped."),
        ],
    )
    reasons = [(r, _number(admission, f"rejected_{r}")) for r in ("budget", "queue_full", "shutdown")]
    if any(v is not None for _, v in reasons):
        family = CounterMetricFamily(
            PREFIX + "admission_rejections", "Requests refused by admission.", labels=["reason"]
        )
        for reason, value in reasons:
            if value is not None:
                family.add_metric([reason], value)
        yield family


def _prompt_cache_series(cache: Mapping[str, Any]) -> Iterator[Metric]:
    yield from _simple(
        cache,
        [
            ("prompt_cache_hits", "counter", "hits", "Prompt-cache lookups that reused a snapshot."),
            ("prompt_cache_misses", "counter", "misses", "Prompt-cache lookups that found nothing."),
            ("prompt_cache_entries", "gauge", "entries", "Snapshots in the RAM prompt cache."),
            ("prompt_cache_bytes", "gauge", "bytes", "Bytes held by the RAM prompt cache."),
            ("prompt_cache_max_bytes", "gauge", "max_bytes", "RAM prompt cache capacity in bytes."),
        ],
    )


_SSD_SPECS = [
    ("ssd_cache_restores", "counter", "restores", "Snapshots restored from the SSD tier."),
    ("ssd_cache_spills", "counter", "spills", "Snapshots written to the SSD tier."),
    ("ssd_cache_dropped_spills", "counter", "dropped_spills", "Spills dropped (queue full)."),
    ("ssd_cache_failed_spills", "counter", "failed_spills", "Spills that failed to write."),
    ("ssd_cache_restore_failures", "counter", "restore_failures", "Restores that failed (bad or missing file)."),
    ("ssd_cache_quarantined", "counter", "quarantined", "SSD records quarantined as corrupt."),
    ("ssd_cache_demotions", "counter", "demotions", "Snapshots demoted from RAM to SSD."),
    ("ssd_cache_restore_ms_last", "gauge", "restore_ms_last", "Duration of the last SSD restore, ms."),
    (
        "ssd_cache_longest_durable_prefix_tokens",
        "gauge",
        "longest_durable_prefix_tokens",
        "Longest prompt prefix durable on SSD, tokens.",
    ),
    ("ssd_cache_entries", "gauge", "entries", "Snapshots on the SSD tier."),
    ("ssd_cache_bytes", "gauge", "bytes", "Bytes on the SSD tier."),
    ("ssd_cache_max_bytes", "gauge", "max_bytes", "SSD tier capacity in bytes."),
    ("ssd_cache_pending_snapshots", "gauge", "pending_snapshots", "Snapshots waiting to be spilled."),
    ("ssd_cache_pending_spills", "gauge", "pending_spills", "Spills queued."),
    ("ssd_cache_pending_spill_bytes", "gauge", "pending_spill_bytes", "Bytes of queued spills."),
]


# vLLM's spec_decode_num_draft_tokens / num_accepted_tokens, summed over every verification step.
_SPEC_SPECS = [
    ("spec_drafted_tokens", "counter", "drafted", "Draft tokens verified by speculative decoding."),
    ("spec_accepted_tokens", "counter", "accepted", "Draft tokens the model accepted."),
]


# The Responses store (api/responses/store.py): its measured memory against its cap.
_RESPONSES_STORE_SPECS = [
    ("responses_store_entries", "gauge", "entries", "Responses kept for previous_response_id."),
    ("responses_store_bytes", "gauge", "bytes", "Memory the Responses store's entries take, measured."),
    ("responses_store_max_bytes", "gauge", "max_bytes", "The Responses store's cap on that memory."),
    ("responses_store_evicted", "counter", "evicted", "Stored responses evicted by the cap."),
    ("responses_store_refused", "counter", "refused", "Responses too large alone for the store's cap."),
]


def _ssd_series(ssd: Mapping[str, Any]) -> Iterator[Metric]:
    yield from _simple(ssd, _SSD_SPECS)


def install_metrics(app: QuartTrio, handles: ServerHandles) -> Metrics:
    """GET /metrics on `app`, fed by every finished request and by `handles.stats()`."""
    existing = app.extensions.get(_EXTENSION_KEY)
    if isinstance(existing, Metrics):
        return existing
    metrics = Metrics(
        stats=handles.stats,
        healthy=lambda: health_problem(handles) is None,
        max_model_len=handles.info.context_length or 131_072,
    )
    monitor = request_monitor(app)
    monitor.listeners.append(metrics.observe_record)
    monitor.interval_listeners.append(metrics.observe_itl)
    app.extensions[_EXTENSION_KEY] = metrics

    async def metrics_view() -> Response:
        # Prometheus' text format 0.0.4 by default; OpenMetrics when the scraper asks for it.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return Response(encode(metrics.registry), content_type=content_type)

    app.add_url_rule("/metrics", "metrics", metrics_view, methods=["GET"])
    return metrics
