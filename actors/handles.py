"""What the HTTP app may touch of the running server: one typed handles object, built by
`actors.root.start_actors`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from actors.admission import Admission
from actors.arrivals import Arrivals
from actors.options import ServeConfig
from actors.policy import AdmissionCeiling, BatchMode
from actors.request import RequestPorts
from actors.scheduler import Scheduler
from actors.worker_api import ModelInfo
from model.params import SamplingParams


@attrs.define(eq=False)
class ServerHandles:
    """Everything the HTTP app may touch; built by `start_actors`."""

    config: ServeConfig
    info: ModelInfo
    tokenizer: Any
    make_sink: Callable[..., Any]  # (detokenizer, *, stop, think) -> CompletionSink
    mode: BatchMode
    ceiling: AdmissionCeiling
    ports: RequestPorts
    admission: Admission
    scheduler: Scheduler
    arrivals: Arrivals = attrs.Factory(Arrivals)  # generation routes count themselves in here
    sampling_defaults: SamplingParams = SamplingParams()
    started_at: float = attrs.Factory(time.time)
    # The worker's PromptCache (mutated on the MLX thread; /stats only reads its ints), or None.
    prompt_cache: Any = None
    # The GPU worker (its `alive` flag drives /health's 503), or None.
    worker: Any = None
    # actors.durability.SsdTier when --ssd-cache is on and the store opened, else None.
    ssd: Any = None

    async def flush_cache(self) -> Any:
        """POST /admin/cache/flush: an actors.messages.FlushResult (durable zeros without SSD)."""
        from actors.messages import FlushResult

        return FlushResult(durable=True) if self.ssd is None else await self.ssd.flush()

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            "server": {"model": self.info.name, "started_at": int(self.started_at), "device": self.info.device},
            "admission": {
                "max_safe_context": self.ceiling.max_safe_context,
                "memory_budget_bytes": self.ceiling.memory_budget_bytes,
                "usable_bytes": self.ceiling.usable_bytes,
                "weights_bytes": self.ceiling.weights_bytes,
                "max_queue": self.admission.max_queue,
                "accepting": not self.admission.closed,
                "in_flight": self.admission.in_flight,
                **attrs.asdict(self.admission.counters),
            },
            "batch": {
                "configured": self.config.batch,
                "mode": self.mode,
                "batched": self.mode == "batch",
                "active_rows": sched.active_rows,
                "pending_rows": len(sched.table.queue),
                "draining": sched.table.draining,
                **attrs.asdict(sched.counters),
                # (row id, reached the queue [ms, server clock], waited [ms], opened with N rows)
                "recent_opens": [(i, round(t * 1e3, 1), round(w * 1e3, 2), n) for i, t, w, n in sched.recent_opens],
            },
            "prompt_cache": (
                {"enabled": True, **self.prompt_cache.stats()}
                if self.prompt_cache is not None
                else {"enabled": False, "entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}
            ),
            **({"ssd_cache": self.ssd.stats()} if self.ssd is not None else {}),
            **({"worker": times.snapshot()} if (times := getattr(self.worker, "times", None)) is not None else {}),
        }


def sampling_defaults_for(
    config: ServeConfig, info: ModelInfo, base: SamplingParams = SamplingParams()
) -> SamplingParams:
    """request > server flag > generation_config.json > fallback; this builds the last three."""
    fields = attrs.fields_dict(SamplingParams)
    values = {k: v for k, v in info.generation_defaults if k in fields}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        flag = getattr(config, key)
        if flag is not None:
            values[key] = flag
    return attrs.evolve(base, **{k: type(getattr(base, k))(v) for k, v in values.items()})
