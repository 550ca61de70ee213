"""The root of the supervision tree: owns the actor nursery and the shutdown order.

Tree (all in one nursery, started in dependency order; any actor crashing takes the server down):

    root
    ├── gpu_worker        loads the model on its own thread, then serves worker calls
    ├── scheduler         inbox: Enqueue / Abort / StopRow      → worker calls, per-row events
    ├── admission         submits: Submit                       → scheduler inbox, replies
    ├── spill_queue       inbox: Spill (--ssd-cache only)      → SSD writes off the MLX thread
    ├── durability        inbox: MarkDirty (worker put hook)    → snapshot jobs, Spill
    ├── demotion_timer    its own cadence, polls `scheduler.busy` → demote jobs, Spill
    ├── response_log      put / delete ops from the Responses routes → fsync'd batches (--response-store)
    ├── (with a model pool, `start_pool`: the MLX thread, and `pool` in place of the worker,
    │    scheduler, admission and SSD tier above, which it starts per resident model: actors/pool.py)
    └── HTTP (hypercorn `serve`, started first: the port is bound before the model loads, and
                  api/http/lifecycle.py answers 503 "loading" until the app is ready; the root
                  decides when it ends and what still runs after it)

Channels: the scheduler's inbox (unbounded `Control`: admission's `Enqueue` / `Abort`, request
actors' `Abort` / `StopRow`) and admission's submits (unbounded `Submit` from request actors)
are opened here; request actors reach both through `RequestPorts`.

Start-up order: HTTP binds (a busy port fails here, before any load) → the worker loads the model
→ scheduler, admission, the SSD-tier actors → the app is served.

Shutdown order (deadlines: `ShutdownPlan`): `Shutdown.requested` → admission closes (503 +
Retry-After for new requests and for admitted ones still queued; started requests' waits are
cut at the plan's drain and end with a final chunk) → the listeners stay open, answering 503
(/health too), until the started requests have ended or the drain deadline → hypercorn closes
its listeners and waits for in-flight responses → `serve` returns →
with the SSD tier: timers stop and the durability flush runs (shielded, within its budget, while
the worker is still alive to take snapshots; its result is what `run_server` returns) → the
actors are cancelled → flush hooks run shielded → return. `Shutdown.now` (a second Ctrl-C)
cancels everything at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import trio
from hypercorn.typing import ASGIFramework

from actors.adapter_registry import AdapterRegistry, mount_flag_adapters
from actors.admission import Admission
from actors.arrivals import Arrivals
from actors.handles import CacheStats, ServerHandles, sampling_defaults_for
from actors.kv_memory import kv_budget
from actors.messages import Control, FlushResult, Submit, WorkerLost
from actors.model_catalog import Servable
from actors.options import resolve
from actors.policy import admission_ceiling, batch_mode, waiting_rows
from actors.pool import ModelPool
from actors.pool_setup import PoolSetup
from actors.request import RequestPorts
from actors.scheduler import Scheduler
from actors.shutdown import Shutdown, ShutdownPlan
from actors.ssd.durability import shutdown_flush, start_ssd_tier
from actors.ssd.response_log import RESPONSE_DRAIN_S, start_response_log
from actors.ssd.view import KeepsSsdTier, SsdView
from actors.startup import listen_failed, load_failed
from actors.worker_api import LosesRows, ModelInfo, Worker
from model.engine.params import SamplingParams

if TYPE_CHECKING:
    from model.options import ServerOptions
    from model.text.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

FlushHook = Callable[[], Awaitable[object]]
ServeHttp = Callable[[ASGIFramework, Callable[[], Awaitable[None]]], Awaitable[None]]
"""`serve_http(app, shutdown_trigger)`: returns once listeners are closed and in-flight
responses are done (hypercorn.trio.serve with its graceful timeout, or a test double)."""


class RunnableWorker(Worker, Protocol):
    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = ...) -> None: ...


@runtime_checkable
class HoldsPromptCache(Protocol):
    """A worker with a prompt cache (created on its MLX thread; None when off)."""

    prompt_cache: CacheStats | None


async def start_actors(
    nursery: trio.Nursery,
    worker: RunnableWorker,
    *,
    options: ServerOptions,
    make_tokenizer: Callable[[ModelInfo], ChatTokenizer],
    sampling_defaults: SamplingParams = SamplingParams(),
    responses: bool = True,
) -> ServerHandles:
    """Start the worker (model load), the scheduler and admission; return the app's handles.
    `responses`: start the durable Responses store too (once per server: a pool's members not)."""
    log.info("loading model %s ...", options.model.model or "(demo)")
    started = time.monotonic()
    info: ModelInfo = await nursery.start(worker.run)
    log.info(
        "model %s loaded in %.1f s (%s, context %d, KV %s)",
        info.name,
        time.monotonic() - started,
        info.device,
        info.context_length,
        info.kv_scheme,
    )
    tokenizer = make_tokenizer(info)
    if options.templates.chat_template is not None:  # --chat-template: the model's own replaced
        from model.text.tokenizer import with_template_file

        tokenizer = with_template_file(tokenizer, options.templates.chat_template)
    resolved = resolve(options, info)  # every auto, for this model on this device
    budget = resolved.memory_budget_bytes
    ceiling = admission_ceiling(
        budget_bytes=budget,
        kv_budget_bytes=resolved.kv_budget_bytes if options.admission.kv_budget_gb is not None else None,
        weights_bytes=info.weights_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        context_length=info.context_length,
        transient_bytes=info.prefill_transient_bytes,
        kv_quant_ratio=info.kv_quant_ratio,
        kv_quantized_from=info.kv_quantized_from,
        state_bytes_per_row=info.state_bytes_per_row,
    )
    if ceiling.max_safe_context < 1:
        # Serve anyway: requests are refused one by one with a clear 400.
        log.warning(
            "memory budget %.2f GB leaves no room for KV after weights (%.2f GB) and the prefill "
            "transient: every request will be refused; raise --memory-budget",
            budget / 1e9,
            info.weights_bytes / 1e9,
        )
    else:
        log.info(
            "admission: max safe context %d tokens (budget %.2f GB, KV %s)",
            ceiling.max_safe_context,
            budget / 1e9,
            _kv_billing(info),
        )
    rows = resolved.batch
    log.info("batch %s -> %d rows", "auto" if options.scheduling.batch is None else options.scheduling.batch, rows)
    mode = batch_mode(rows, batchable=info.batchable)

    inbox_send, inbox_recv = trio.open_memory_channel[Control](float("inf"))
    grouped = mode == "batch" and resolved.group_prefill
    arrivals = Arrivals()
    admission = Admission(
        ceiling=ceiling,
        mode=mode,
        max_queue=options.admission.max_queue,
        # Rows a free batch slot takes at once do not wait: --max-queue counts only the rest.
        waiting=lambda: waiting_rows(
            pending=scheduler.pending_rows(admission.enqueued), active=scheduler.active_rows, capacity=rows, mode=mode
        ),
        scheduler=inbox_send,
    )
    scheduler = Scheduler(
        worker,
        capacity=rows,
        inbox=inbox_recv,
        # A route counts itself as arriving until `admit` returns, which is when its row opens:
        # the requests admission already answered are in the queue, not on their way in.
        pending_arrivals=lambda: max(0, arrivals.pending - admission.queued),
        arrival_window=options.scheduling.arrival_window_ms / 1000,
        group_prefill_tokens=resolved.engine.prefill_chunk if grouped else 0,
        decoding_prefill_chunk=resolved.decoding_prefill_chunk,
        kv_budget=kv_budget(resolved.kv_budget_bytes, info),
        # A preempted row resumes from the prompt cache: without one, none is preempted.
        preempts=info.preemptible and resolved.prompt_cache_bytes > 0,
        step_tokens=1 + (options.speculation.num_draft_tokens if info.speculation else 0),
    )
    arrivals.on_settled = scheduler.nudge
    admission.on_queued = scheduler.nudge
    if isinstance(worker, LosesRows):  # (an isolated engine died: its rows fail at once)
        worker.on_lost = lambda error: inbox_send.send_nowait(WorkerLost(error))
    await nursery.start(scheduler.run)

    submits_send, submits_recv = trio.open_memory_channel[Submit](float("inf"))
    await nursery.start(admission.run, submits_recv)

    # The cache SSD tier: spill_queue, durability, demotion_timer — when the worker opened an
    # SSD store (--ssd-cache); background work yields to `scheduler.busy`. An isolated engine
    # runs them in its own process.
    ssd: SsdView | None
    if isinstance(worker, KeepsSsdTier):
        ssd = worker.ssd_tier
    else:
        ssd = await start_ssd_tier(
            nursery,
            worker,
            busy=lambda: scheduler.busy,
            spill_queue_bytes=int(options.caches.ssd_spill_queue_gb * 2**30),
            demote_idle_s=options.caches.ssd_demote_idle_s,
        )

    handles = ServerHandles(
        options=options,
        resolved=resolved,
        info=info,
        tokenizer=tokenizer,
        mode=mode,
        ceiling=ceiling,
        ports=RequestPorts(
            submits=submits_send, control=inbox_send, admission=admission, speculation=bool(info.speculation)
        ),
        admission=admission,
        scheduler=scheduler,
        arrivals=arrivals,
        sampling_defaults=sampling_defaults_for(options.sampling, info, sampling_defaults),
        prompt_cache=worker.prompt_cache if isinstance(worker, HoldsPromptCache) else None,
        worker=worker,
        ssd=ssd,
        responses=await start_response_log(nursery, options) if responses else None,  # stored Responses on disk
        adapters=AdapterRegistry(worker),
    )
    await mount_flag_adapters(handles.adapters, options.adapters.adapters)  # --adapter: a bad one fails start-up
    return handles


async def start_pool(nursery: trio.Nursery, setup: PoolSetup) -> tuple[ServerHandles, ModelPool]:
    """Start the shared MLX thread and the model pool, load the default model (its handles are
    the app's, the Responses store on them); every member is started by `start_actors`."""
    options = setup.options
    await nursery.start(setup.thread.run)

    async def start_member(member_nursery: trio.Nursery, model: Servable) -> ServerHandles:
        worker, make_tokenizer = setup.worker(model)
        member_options = setup.options_for(model)
        log.info("loading model %s ...", model.id)
        return await start_actors(
            member_nursery, worker, options=member_options, make_tokenizer=make_tokenizer, responses=False
        )

    pool = ModelPool(
        setup.catalog,
        start_member,
        size=options.model.model_pool,
        ttl_s=options.model.model_ttl,
        load_timeout_s=options.model.model_load_timeout,
        thread=setup.thread,
    )
    await nursery.start(pool.run)
    handles = await pool.start()
    handles.responses = await start_response_log(nursery, options)
    return handles, pool


class Gate(Protocol):
    """Who closes at shutdown and whose requests the drain waits for: admission, or a pool's."""

    cutoff: float

    @property
    def in_flight(self) -> int: ...

    def close(self, *, cutoff_after: float) -> None: ...

    async def wait_idle(self) -> None: ...


def _kv_billing(info: ModelInfo) -> str:
    """How admission bills the KV, for the start-up log."""
    if not info.kv_quantized_from:
        return info.kv_scheme
    return f"{info.kv_scheme}: {info.kv_quant_ratio:.3f} of full precision past {info.kv_quantized_from} tokens"


async def run_server(
    worker: RunnableWorker | None,
    *,
    options: ServerOptions,
    make_tokenizer: Callable[[ModelInfo], ChatTokenizer],
    serve_http: ServeHttp,
    shutdown: Shutdown,
    plan: ShutdownPlan | None = None,
    make_app: Callable[[ServerHandles], ASGIFramework] | None = None,
    flush_hooks: Sequence[FlushHook] = (),
    trace: Callable[[str], None] = lambda milestone: None,
    pool: PoolSetup | None = None,
) -> FlushResult | None:
    """Bind, load, serve until shutdown; returns normally on a clean or a timed-out shutdown
    alike. Returns the shutdown durability flush's FlushResult (durable=False if it never ran),
    or None without an SSD tier. `plan` defaults to the one `options` imply. A bind failure (or
    a worker that fails to load) propagates. With `pool` (a model pool) the pool builds every
    model's worker and `worker` is unused."""
    from api.http.lifecycle import LifecycleApp

    if make_app is None:
        from api.app import create_app

        make_app = create_app
    if plan is None:
        plan = ShutdownPlan.for_options(options)
    drain = plan.drain
    bind = options.http

    lifecycle = LifecycleApp()  # answers 503 "loading" until the model is loaded
    handles: ServerHandles | None = None
    front: Gate | None = None  # admission, or the pool's gate over every model's
    models: ModelPool | None = None
    flushed: FlushResult | None = None
    flush_scope = trio.CancelScope(shield=True)  # only a second signal cuts the flush short
    load_scope = trio.CancelScope()
    http_scope = trio.CancelScope()
    bound = trio.Event()
    http_done = trio.Event()
    async with trio.open_nursery() as nursery:

        async def escalate() -> None:
            await shutdown.now.wait()
            trace("hard cancel")
            flush_scope.cancel()
            nursery.cancel_scope.cancel()

        async def gate() -> None:
            await shutdown.requested.wait()
            # hypercorn's graceful timeout counts from its trigger, which may fire as late as the
            # drain deadline: HTTP's own deadline is counted from the signal here instead.
            http_scope.deadline = trio.current_time() + plan.http_deadline
            if handles is None or front is None:  # a signal during model load: nothing to drain
                load_scope.cancel()
                return
            front.close(cutoff_after=drain)
            log.info(
                "shutting down: admission closed; %d in-flight request(s) get up to %.0f s",
                front.in_flight,
                drain,
            )
            trace("admission closed")

        async def listeners_close() -> None:
            """hypercorn's shutdown trigger. hypercorn awaits it only once its listeners are
            bound, so its first call says the port is ours. It returns — and the listeners
            close — once the admitted requests have ended (new ones meanwhile get 503 and
            /health says "shutting down"), at the latest at the drain deadline."""
            bound.set()
            await shutdown.requested.wait()
            if front is not None:
                with trio.move_on_at(front.cutoff):
                    await front.wait_idle()
            trace("listeners closing")

        async def http() -> None:
            with http_scope:
                try:
                    await serve_http(lifecycle, listeners_close)
                except Exception as exc:
                    if bound.is_set():
                        raise
                    raise listen_failed(bind.host, bind.port, exc, unix=bind.unix) from exc
            http_done.set()

        nursery.start_soon(escalate)
        nursery.start_soon(gate)
        nursery.start_soon(http)
        await bound.wait()  # a bind failure raises out of the nursery instead
        trace("listening")
        if bind.unix is not None:
            log.info("listening on unix:%s (mode %03o; OpenAI API at /v1)", bind.unix, bind.unix_mode)
        else:
            log.info("listening on http://%s:%d (OpenAI API at /v1)", bind.host, bind.port)
        if not options.access.api_key and bind.unix is None and bind.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s without --api-key: anyone who can reach this port can use /v1", bind.host)
        with load_scope:
            try:
                if pool is not None:
                    handles, models = await start_pool(nursery, pool)
                    front = models
                else:
                    assert worker is not None, "a server without a pool serves its one worker"
                    handles = await start_actors(nursery, worker, options=options, make_tokenizer=make_tokenizer)
                    front = handles.admission
            except Exception as exc:
                raise load_failed(options.model.model, exc) from exc
        if handles is not None and front is not None:
            lifecycle.serve(make_app(handles))
            trace("serving")
            log.info("ready: serving model %s", handles.info.name)
            nursery.start_soon(_end_http_once_drained, front, shutdown, http_scope, plan.drained_http_grace)
        await http_done.wait()
        trace("http done")
        if handles is not None and front is not None:
            log.info("HTTP server stopped; %d request(s) still in flight", front.in_flight)
            if models is not None:
                with flush_scope:
                    flushed = await models.shutdown_flush(timeout=plan.durability_flush)
                    trace("durability flushed")
            elif handles.ssd is not None:
                with flush_scope:
                    flushed = await shutdown_flush(handles.ssd, timeout=plan.durability_flush)
                    trace("durability flushed")
            if handles.responses is not None:  # (every answered put is already on disk)
                with trio.move_on_after(RESPONSE_DRAIN_S) as drain_scope:
                    drain_scope.shield = True
                    await handles.responses.drain()
        nursery.cancel_scope.cancel()
    trace("actors stopped")
    await run_flush_hooks(flush_hooks, budget=plan.flush_hooks)
    trace("flushed")
    ssd_tier = handles is not None and (handles.ssd is not None or (models is not None and models.had_ssd))
    if ssd_tier and flushed is None:
        flushed = FlushResult(durable=False)  # cut by a second signal or never reached
    return flushed


async def _end_http_once_drained(front: Gate, shutdown: Shutdown, http_scope: trio.CancelScope, grace: float) -> None:
    """hypercorn keeps an idle keep-alive connection (an SDK's pool) open through its whole
    graceful timeout, so Ctrl-C would wait `--shutdown-timeout` for nothing. Once every admitted
    request has ended and its last frame had a moment to go out, end HTTP ourselves."""
    await shutdown.requested.wait()
    await front.wait_idle()
    await trio.sleep(grace)
    http_scope.cancel()


async def run_flush_hooks(hooks: Sequence[FlushHook], *, budget: float) -> None:
    """Shielded and bounded: runs even when the root was cancelled, never hangs the exit."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(budget) as scope:
            for hook in hooks:
                try:
                    await hook()
                except Exception:
                    log.exception("flush hook %r failed", hook)
        if scope.cancelled_caught:
            log.warning("flush hooks overran %.0f s; exiting without them", budget)
