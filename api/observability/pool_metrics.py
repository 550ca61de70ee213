"""GET /metrics with a model pool (actors/pool.py): per-model series, labelled `model`, beside the
default model's unlabelled ones (api/observability/metrics.py), and the pool's own counters.

* `mlx_trio:model_loaded{model}`: 1 for a resident model, 0 for one loading or unloaded;
* `model_requests_in_flight{model}`, `model_requests_running{model}`: its admission's
  `in_flight`, its batch's `active_rows`;
* `model_generation_tokens_total{model}`, `model_admitted_requests_total{model}`: its batch's
  `tokens` and admission's `admitted`, counted since its last load;
* `model_weights_bytes{model}`: its weights;
* `model_pool_{loads,load_failures,evictions,expirations,unloads}_total`: the pool's counters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.handles import ModelPoolView

PREFIX = "mlx_trio:"
_POOL_COUNTERS = {
    "loads": "Models loaded into the pool.",
    "load_failures": "Model loads that failed.",
    "evictions": "Models unloaded to make room (least recently used).",
    "expirations": "Models unloaded after --model-ttl idle.",
    "unloads": "Models unloaded on POST /admin/models/unload.",
}
# (metric, kind, stats block, key, help) per resident model
_PER_MODEL = [
    ("model_requests_in_flight", "gauge", "admission", "in_flight", "Admitted requests not yet ended, per model."),
    ("model_requests_running", "gauge", "batch", "active_rows", "Rows running, per model."),
    ("model_generation_tokens", "counter", "batch", "tokens", "Tokens generated since the model's last load."),
    ("model_admitted_requests", "counter", "admission", "admitted", "Requests admitted since the model's last load."),
    ("model_weights_bytes", "gauge", None, "weights_bytes", "The model's weights in memory."),
]


class PoolCollector:
    def __init__(self, pool: ModelPoolView) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily(PREFIX + "model_loaded", "1 while the model is resident.", labels=["model"])
        for entry in self._pool.entries():
            loaded.add_metric([entry.id], 1.0 if entry.status == "loaded" else 0.0)
        yield loaded
        stats = self._pool.stats()
        resident: Mapping[str, Any] = stats.get("resident", {})
        for name, kind, block, key, doc in _PER_MODEL:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(PREFIX + name, doc, labels=["model"])
            for model_id, model_stats in resident.items():
                source = model_stats if block is None else model_stats.get(block, {})
                value = source.get(key) if isinstance(source, Mapping) else None
                if isinstance(value, (int, float)):
                    family.add_metric([model_id], float(value))
            yield family
        for key, doc in _POOL_COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + f"model_pool_{key}", doc)
            counter.add_metric([], float(stats.get(key, 0)))
            yield counter


def install_pool_metrics(registry: CollectorRegistry, pool: ModelPoolView) -> None:
    """The pool's series on the app's metrics registry."""
    registry.register(PoolCollector(pool))
