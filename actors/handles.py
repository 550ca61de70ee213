"""What the HTTP app may touch of the running server: one typed handles object, built by
`actors.root.start_actors`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from actors.adapter_registry import AdapterRegistry, ceiling_with_adapters
from actors.admission import Admission
from actors.arrivals import Arrivals
from actors.kv_memory import kv_budget
from actors.messages import FlushResult
from actors.options import Resolved
from actors.policy import AdmissionCeiling, BatchMode
from actors.pool_types import PoolEntry
from actors.request import RequestPorts
from actors.scheduler import Scheduler
from actors.worker_api import ModelInfo, Worker
from model.engine.params import SamplingParams
from model.options import SamplingOptions, ServerOptions

if TYPE_CHECKING:
    from actors.ssd.drain import DrainReport
    from actors.ssd.response_log import ResponseLog
    from actors.ssd.view import SsdView
    from model.engine.machine import MachineFacts
    from model.engine.scoring import PromptScore
    from model.text.tokenizer import ChatTokenizer


class CacheStats(Protocol):
    """The prompt cache as /stats reads it (its ints are written on the MLX thread)."""

    def stats(self) -> dict[str, Any]: ...


class JobTimes(Protocol):
    """The worker's time accounting (actors.gpu_worker.WorkerTimes)."""

    def snapshot(self) -> dict[str, Any]: ...


@runtime_checkable
class ReportsAlive(Protocol):
    """A worker that says whether its MLX thread runs (/health answers 503 when it does not).
    A worker without the flag counts as alive."""

    alive: bool


@runtime_checkable
class ReportsFailure(Protocol):
    """A worker whose engine can fail for good (actors/isolate/worker.py: it died more often than
    it may restart): `failure` says why, None while it serves (or is being restarted)."""

    failure: str | None


@runtime_checkable
class ReportsTimes(Protocol):
    """A worker that keeps time accounting (/stats shows it as `worker`)."""

    times: JobTimes


@runtime_checkable
class ScoresPrompts(Protocol):
    """A worker that scores prompts (/v1/completions' prompt logprobs: `GpuWorker.score`);
    ValueError: it cannot for this request (an adapter not mounted, tensor parallelism)."""

    async def score(self, tokens: list[int], *, top: int = 0, adapters: tuple[str, ...] = ()) -> list[PromptScore]: ...


@runtime_checkable
class ReportsMachine(Protocol):
    """A worker that says what its device is and how fast it reads memory (GET /fit)."""

    async def machine(self) -> MachineFacts: ...


@runtime_checkable
class SetsOtherWeights(Protocol):
    """A worker whose rows and prompt cache share the budget with other models' weights
    (actors/gpu_worker.py `set_other_weights`)."""

    def set_other_weights(self, nbytes: int) -> None: ...


class ModelPoolView(Protocol):
    """The model pool (actors/pool.py `ModelPool`) as the app sees it. Its methods raise
    `actors.pool_types.PoolError`s, each with its HTTP status."""

    def entries(self) -> list[PoolEntry]:
        """Every servable model, the default first."""
        ...

    def resident(self, model_id: str) -> ServerHandles | None:
        """The handles of a loaded model, else None."""
        ...

    def find(self, name: str) -> str | None:
        """The id of the servable model `name` names (an alias included), else None."""
        ...

    def alive(self) -> bool:
        """Whether the MLX thread every model runs on is running."""
        ...

    async def acquire(self, name: str) -> ServerHandles:
        """The loaded model `name` names, loaded now when it is not (the LRU idle one leaves)."""
        ...

    async def unload(self, name: str, *, wait: bool = True) -> DrainReport:
        """Unload it once its running rows end (or ModelBusy when not `wait`)."""
        ...

    async def drain(self, name: str) -> DrainReport:
        """Hold new requests, let the running rows end, demote its prompt cache to the SSD tier."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def failed(self) -> dict[str, str]:
        """Each resident model whose engine failed for good, and why."""
        ...


@attrs.define(eq=False)
class ServerHandles:
    """Everything the HTTP app may touch; built by `start_actors`."""

    options: ServerOptions
    resolved: Resolved  # the options' autos, for this model and device
    info: ModelInfo
    tokenizer: ChatTokenizer
    mode: BatchMode
    ceiling: AdmissionCeiling
    ports: RequestPorts
    admission: Admission
    scheduler: Scheduler
    arrivals: Arrivals = attrs.Factory(Arrivals)  # generation routes count themselves in here
    sampling_defaults: SamplingParams = SamplingParams()
    started_at: float = attrs.Factory(time.time)
    prompt_cache: CacheStats | None = None  # the worker's prompt cache, when it has one
    worker: Worker | None = None
    ssd: SsdView | None = None  # when --ssd-cache is on and the store opened (here, or in the engine's process)
    responses: ResponseLog | None = None  # the durable Responses store (--response-store, or under --ssd-cache)
    adapters: AdapterRegistry = attrs.Factory(AdapterRegistry)  # mounted LoRA adapters
    # /stats blocks the app adds for what it owns itself (the Responses store: api/responses/routes.py).
    stats_blocks: dict[str, Callable[[], dict[str, Any]]] = attrs.Factory(dict)
    # Several models in one server (--model-pool, --models-dir): the pool picks each request's
    # model; None serves this one model alone.
    pool: ModelPoolView | None = None

    def __attrs_post_init__(self) -> None:
        self.adapters.on_change = self._bill_adapters

    def _bill_adapters(self, nbytes: int) -> None:
        """Mounted adapters' weights come out of admission's memory budget, and of the live-KV
        budget all rows share."""
        self.ceiling = self.admission.ceiling = ceiling_with_adapters(self.ceiling, self.info, nbytes)
        if self.scheduler.kv_budget is not None:
            self.scheduler.kv_budget = kv_budget(max(0, self.ceiling.usable_bytes), self.info)

    def bill_other_models(self, nbytes: int) -> None:
        """A model pool's other resident models hold `nbytes` of weights in the same memory
        budget: they come out of admission's budget, the live-KV budget and the worker's room."""
        ceiling = attrs.evolve(self.ceiling, other_weights_bytes=nbytes)
        self.ceiling = self.admission.ceiling = ceiling_with_adapters(ceiling, self.info, ceiling.adapter_bytes)
        if self.scheduler.kv_budget is not None:
            self.scheduler.kv_budget = kv_budget(max(0, self.ceiling.usable_bytes), self.info)
        if isinstance(self.worker, SetsOtherWeights):
            self.worker.set_other_weights(nbytes)

    async def flush_cache(self) -> FlushResult:
        """POST /admin/cache/flush: durable, with zeros, without the SSD tier."""
        return FlushResult(durable=True) if self.ssd is None else await self.ssd.flush()

    def worker_failure(self) -> str | None:
        """Why this model's engine failed for good (an isolated one that kept dying), else None."""
        return self.worker.failure if isinstance(self.worker, ReportsFailure) else None

    def failed_models(self) -> dict[str, str]:
        """Every model that failed for good (/health's "degraded"), by name."""
        if self.pool is not None:
            return self.pool.failed()
        failure = self.worker_failure()
        return {} if failure is None else {self.info.name: failure}

    def worker_alive(self) -> bool:
        if self.pool is not None:  # (this model may have left the pool; the MLX thread serves the rest)
            return self.pool.alive()
        return not isinstance(self.worker, ReportsAlive) or self.worker.alive

    def stats(self) -> dict[str, Any]:
        """/stats: this model's blocks, and with a model pool every resident model's (`models`);
        the top-level blocks are then the default model's latest load while it is resident."""
        if self.pool is None:
            return self.model_stats()
        now = self.pool.resident(self.info.name)
        stats = now.model_stats() if now is not None else self.unloaded_stats()
        stats.update({name: block() for name, block in self.stats_blocks.items()})  # (the app's own)
        stats["models"] = self.pool.stats()
        return stats

    def unloaded_stats(self) -> dict[str, Any]:
        """/stats' top level while a model pool's default model is not resident (unloaded, evicted,
        loading again): these handles are a load that is gone, so none of its blocks (rows, live
        KV, prompt cache, counters) is shown; the server, and the MLX thread every model shares."""
        stats: dict[str, Any] = {
            "server": {"model": self.info.name, "started_at": int(self.started_at), "device": self.info.device}
        }
        if not self.options.engine.isolate and isinstance(self.worker, ReportsTimes):  # (isolated: its own)
            stats["worker"] = self.worker.times.snapshot()
        return stats

    def model_stats(self) -> dict[str, Any]:
        sched = self.scheduler
        return {
            "server": {"model": self.info.name, "started_at": int(self.started_at), "device": self.info.device},
            "admission": {
                "max_safe_context": self.ceiling.max_safe_context,
                "context_length": self.ceiling.context_length,
                "memory_context": self.ceiling.memory_context(1),
                "memory_budget_bytes": self.ceiling.memory_budget_bytes,
                "usable_bytes": self.ceiling.usable_bytes,
                "weights_bytes": self.ceiling.weights_bytes,
                "prefill_transient_bytes": self.ceiling.transient_bytes,
                "adapter_bytes": self.ceiling.adapter_bytes,
                **({"other_models_bytes": self.ceiling.other_weights_bytes} if self.pool is not None else {}),
                "max_queue": self.admission.max_queue,
                "accepting": not self.admission.closed,
                "in_flight": self.admission.in_flight,
                **attrs.asdict(self.admission.counters),
            },
            "batch": {
                "configured": self.resolved.batch,
                "mode": self.mode,
                "batched": self.mode == "batch",
                "active_rows": sched.active_rows,
                # Rows admitted and not opened yet (each choice a row), and of them those beyond
                # the free batch slots: what --max-queue bounds.
                "pending_rows": sched.pending_rows(self.admission.enqueued),
                "waiting_rows": self.admission.waiting_rows,
                "draining": sched.table.draining,
                # Live KV as the scheduler bills it (rows padded to the batch's longest), against
                # the budget all rows share; `peak_kv_bytes`, `preemptions`, `resumes` below.
                "kv_bytes": sched.table.kv_bytes(),
                **({"kv_budget_bytes": sched.kv_budget.budget_bytes} if sched.kv_budget is not None else {}),
                **attrs.asdict(sched.counters),
                # (row id, reached the queue [ms, server clock], waited [ms], opened with N rows)
                "recent_opens": [(i, round(t * 1e3, 1), round(w * 1e3, 2), n) for i, t, w, n in sched.recent_opens],
            },
            "kv_quant": kv_quant_stats(self.info),
            "speculation": speculation_stats(self.info, sched.counters.drafted_tokens, sched.counters.accepted_tokens),
            "prompt_cache": (
                {"enabled": True, **self.prompt_cache.stats()}
                if self.prompt_cache is not None
                else {"enabled": False, "entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}
            ),
            **({"ssd_cache": self.ssd.stats()} if self.ssd is not None else {}),
            **({"worker": self.worker.times.snapshot()} if isinstance(self.worker, ReportsTimes) else {}),
            **{name: block() for name, block in self.stats_blocks.items()},
        }


def kv_quant_stats(info: ModelInfo) -> dict[str, Any]:
    """/stats' `kv_quant`: the KV storage scheme and how admission bills it (paged: by each row's
    own blocks)."""
    return {
        "mode": info.kv_scheme,
        "group_size": info.kv_group_size,
        "start": info.kv_start,
        "bits": list(info.kv_bits) if isinstance(info.kv_bits, tuple) else info.kv_bits,
        "ratio": round(info.kv_quant_ratio, 6),
        "quantized_from": info.kv_quantized_from,
        "paged": info.kv_paged,  # --paged-kv
    }


def speculation_stats(info: ModelInfo, drafted: int, accepted: int) -> dict[str, Any]:
    """/stats' `speculation`: the drafter ("" = off) and the draft tokens verified and accepted."""
    return {
        "mode": info.speculation,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 6) if drafted else None,
    }


def sampling_defaults_for(
    options: SamplingOptions, info: ModelInfo, base: SamplingParams = SamplingParams()
) -> SamplingParams:
    """request > server flag > generation_config.json > fallback; this builds the last three."""
    fields = attrs.fields_dict(SamplingParams)
    values = {k: v for k, v in info.generation_defaults if k in fields}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        flag = getattr(options, key)
        if flag is not None:
            values[key] = flag
    return attrs.evolve(base, **{k: type(getattr(base, k))(v) for k, v in values.items()})
