"""GPU-worker actor: the only owner of MLX objects.

Inbound: job calls from the scheduler (`open_row`, `prefill`, `prefill_group`, `fork_rows`, `join`,
`join_group`, `step`, `close_row`), from the embeddings route (`embed`: jobs of its own between
those calls), /v1/completions' prompt logprobs (`score`, the same), the SSD tier (`run_exclusive`,
`snapshot`, `demote_idle`): each an awaited method that puts a `_Job` on the worker's job queue.
Outbound: each job's result (or exception) on that job's reply channel (buffer 1); with the SSD
tier, every prompt-cache put is posted to the put listener (durability's `MarkDirty`).

Neither direction makes the MLX thread wait for the trio thread: jobs arrive on a thread-safe
queue (the worker blocks on it with the GIL released) and replies are posted with
`run_sync_soon`. Under load the trio thread is busy with every stream's per-token work; a
blocking hand-off (`trio.from_thread.run`) would idle the device until the event loop came round.

The actor's whole life is one dedicated OS thread (its own, not trio's thread cache) that loads
the model itself (MLX arrays, weights included, are bound to the thread that created them) and
then runs jobs one at a time. A job is never interrupted: a caller that is cancelled while waiting
merely stops listening, and the job's result is dropped. So rows always leave at step boundaries.
The one early end is a prefill's own: `abort(row_id)` (not a job) flags the row, and a prefill
forward of it stops at its next check between layers (model/engine/prefill_abort.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import outcome
import trio

from actors.adapter_registry import mounted_for
from actors.kv_memory import buffer_cache_bytes
from actors.options import resolve
from actors.tp.leader import TensorParallel
from actors.worker_api import AdapterReport, ModelInfo, NotAnEmbeddingModel, kv_fields, loaded_fields
from actors.worker_memory import after_row_job, device_memory_bytes
from model.engine.abort_flags import AbortFlags
from model.engine.prefill_memory import prefill_transient_bytes
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.engine.speculation_setup import spec_choice
from model.load.embedding_config import Pooling, plan_jobs
from model.options import ServerOptions

if TYPE_CHECKING:  # these import MLX: only ever on the worker's thread
    from cache.prompt_cache import PromptCache
    from cache.spill_item import SpillItem
    from cache.ssd_store import SsdStore
    from cache.tiered import TieredPromptCache
    from model.engine.engine import Engine
    from model.engine.machine import MachineFacts
    from model.engine.scoring import PromptScore
    from model.load.loader import LoadedModel

log = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.define(eq=False)
class _Job:
    fn: Callable[[Engine], Any]
    reply: trio.MemorySendChannel
    kind: str = "other"  # what /stats counts its time under
    abandoned: bool = False  # its caller was cancelled before the worker took it: skip it


@attrs.define
class WorkerTimes:
    """Where the MLX thread's time goes (seconds; written on that thread, read by /stats).
    `idle_s` is time spent waiting for the next job; `idle_decoding_s` the part of it while rows
    were decoding: the scheduler's turn-around, time the event loop did not hand work to."""

    jobs: dict[str, int] = attrs.Factory(dict)
    busy_s: dict[str, float] = attrs.Factory(dict)
    idle_s: float = 0.0
    idle_decoding_s: float = 0.0  # the part of idle_s while rows were decoding
    warm_up_s: float = 0.0

    def add(self, kind: str, seconds: float) -> None:
        self.jobs[kind] = self.jobs.get(kind, 0) + 1
        self.busy_s[kind] = self.busy_s.get(kind, 0.0) + seconds

    def snapshot(self) -> dict[str, Any]:
        return {
            "idle_s": round(self.idle_s, 4),
            "idle_decoding_s": round(self.idle_decoding_s, 4),
            "warm_up_s": round(self.warm_up_s, 4),
            "jobs": dict(self.jobs),
            "busy_s": {k: round(v, 4) for k, v in self.busy_s.items()},
        }


class WorkerDied(RuntimeError):
    """The GPU-worker thread is gone; no MLX work can run any more."""


class GpuWorker:
    def __init__(
        self,
        model_dir: Path,
        options: ServerOptions,
        *,
        name: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        protected_ids: Iterable[int] = (),
    ) -> None:
        """The worker for `model_dir`, built as `options` say (the groups it reads: engine, kv,
        speculation, caches; `--batch` and `--warm-up` through `actors.options.resolve`). Raises
        ModelLoadError when --draft-model does not resolve."""
        self.model_dir = Path(model_dir)
        self.options = options
        self.speculation = spec_choice(options.speculation)  # built into the engine once the target loads
        self.tp = TensorParallel(options.engine.tensor_parallel)  # --tensor-parallel: actors/tp/leader.py
        self.times = WorkerTimes()
        self.name = name
        self._eos = None if eos_token_ids is None else frozenset(eos_token_ids)
        self._protected = frozenset(protected_ids)
        caches = options.caches
        # Off only when --prompt-cache 0 or under tensor parallelism; sized once the model is loaded.
        self.prompt_cache_on = caches.prompt_cache_gb != 0
        self.prompt_cache_bytes = self._kv_room = 0  # (_kv_room: what rows and the cache share)
        # Read from the trio side for /stats: plain ints only, so no lock is needed.
        self.prompt_cache: PromptCache | None = None
        self._tiered: TieredPromptCache | None = None
        # SSD tier: built on the MLX thread with the RAM tier; None when off or unusable.
        self.ssd_cache_dir = None if caches.ssd_cache_dir is None else Path(caches.ssd_cache_dir)
        self.ssd_store: SsdStore | None = None
        self._put_listener: Callable[[str, tuple[int, ...]], None] | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None ends the loop
        self.alive = False
        self.info: ModelInfo | None = None
        self.thread_ident: int | None = None
        self._current_reply: trio.MemorySendChannel | None = None
        # Rows being aborted: written here from the trio thread, read by a running prefill.
        self._aborts = AbortFlags()
        self.pooling: Pooling | None = None  # an embedding model's, once loaded
        self._machine: MachineFacts | None = None  # measured on the first GET /fit

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward (the root sizes group prefills by it)."""
        return self.options.engine.prefill_chunk

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        self._trio_token = token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        ended: list[outcome.Outcome] = []

        def body() -> None:
            ended.append(outcome.capture(self._thread_main, task_status))
            self.tp.close()  # the followers stop with this rank's MLX thread
            # MLX keeps per-thread streams; a thread that used MLX must drop them before it ends,
            # or interpreter exit aborts ("terminate called without an active exception",
            # ml-explore/mlx#3126).
            try:
                import mlx.core as mx

                mx.clear_streams()
            except Exception:
                log.debug("mx.clear_streams failed", exc_info=True)
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:
                pass

        # Our own thread, not trio's thread cache: a cached thread idles on after the job and can
        # exit during interpreter shutdown, when MLX's thread-local compile cache (it holds Python
        # objects) can no longer take the GIL — the process then aborts. This one ends with us.
        thread = threading.Thread(target=body, name="mlx-gpu-worker")
        thread.start()
        try:
            try:
                await finished.wait()
            finally:
                # Shutdown: end the job loop; a job already running finishes first (rows leave at
                # step boundaries), so wait for the thread, shielded.
                self._jobs.put(None)
                with trio.CancelScope(shield=True):
                    await finished.wait()
                thread.join()
            ended[0].unwrap()
        finally:
            self.alive = False
            self.close_ssd()  # releases the SSD directory lock (a writer may still finish)
            if self._current_reply is not None:
                self._current_reply.close()  # a caller mid-job sees WorkerDied, not a hang
            while True:  # and so does one whose job was still queued
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.reply.close()

    def _thread_main(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        # Everything MLX is imported and created here, on this thread only.
        import mlx.core as mx

        from cache.prompt_cache import PromptCache
        from model.engine.build import build_engine, eos_of, kv_scheme_for
        from model.kv.rows import resumable
        from model.load.loader import load_model

        self.thread_ident = threading.get_ident()
        loaded = load_model(self.model_dir, name=self.name)
        kv_scheme = kv_scheme_for(loaded, self.options.kv)  # (a bad kv_config.json: before anything starts)
        eos = eos_of(loaded, self._eos)
        self.tp.start(self, loaded, eos, self._trio_token)  # (size 1: nothing)
        self.pooling = loaded.pooling
        if self.prompt_cache_on:  # (sized below, once the budget is resolved, before any put)
            self._tiered = self._make_prompt_cache(loaded)  # (an empty cache is falsy: test for None)
            self.prompt_cache = self._tiered
            if self.prompt_cache is None:
                share = self.options.caches.cache_retention_share
                self.prompt_cache = PromptCache(0, retention_share=share)
        built = build_engine(
            loaded,
            engine=self.options.engine,
            kv_scheme=kv_scheme,
            speculation=self.speculation,
            eos_token_ids=eos,
            protected_ids=self._protected,
            prompt_cache=self.prompt_cache,
            aborts=self._aborts if self.tp.size == 1 else None,  # (a mid-forward stop cannot be mirrored)
        )
        engine = self.tp.wrap(built.engine)  # --tensor-parallel: its row calls mirrored to the followers
        device = mx.default_device()
        self.info = ModelInfo(
            name=loaded.name,
            context_length=loaded.config.max_position_embeddings,
            weights_bytes=loaded.weights_bytes,
            kv_bytes_per_token=loaded.kv_bytes_per_token,
            eos_token_ids=eos,
            device=str(device.type).rsplit(".", 1)[-1],
            backend="cpu" if device.type != mx.gpu else "metal" if mx.metal.is_available() else "cuda",
            memory_bytes=device_memory_bytes(mx),
            model_type=loaded.config.model_type,
            speculation=built.speculation,
            # (a preempted row resumes from the prompt cache; its ranks' caches cannot follow)
            preemptible=resumable(kv_scheme, loaded.model.make_caches()) and self.tp.size == 1 and self.prompt_cache_on,
            prefill_transient_bytes=prefill_transient_bytes(
                loaded.config.raw, chunk=self.options.engine.prefill_chunk, dtype_bytes=loaded.kv_dtype.size
            ),
            **loaded_fields(loaded),
            generation_defaults=tuple(
                (k, v) for k, v in attrs.asdict(loaded.config.generation).items() if v is not None
            ),
            **kv_fields(
                kv_scheme,
                num_layers=len(loaded.model.layers),
                dtype_name=str(loaded.kv_dtype),
                dtype_bytes=loaded.kv_dtype.size,
                prefill_chunk=self.options.engine.prefill_chunk,
            ),
        )
        resolved = resolve(self.options, self.info)  # --batch auto is sized once the model is loaded
        self._kv_room = resolved.kv_room_bytes
        mx.set_cache_limit(buffer_cache_bytes(self.info.prefill_transient_bytes))
        if self.prompt_cache is not None:
            self.prompt_cache_bytes = self.prompt_cache.max_bytes = resolved.prompt_cache_bytes
        batch = resolved.batch if resolved.warm_up else 0
        if loaded.pooling is not None:
            batch = 0  # an embedding model never decodes
        if batch > 0:
            started = time.perf_counter()
            engine.warm_up(batch)
            self.times.warm_up_s = time.perf_counter() - started
            log.info(
                "warmed up decode batch sizes 1..%d and %d prefill shapes in %.1f s",
                batch,
                len(engine.prefill_shapes(batch)),
                self.times.warm_up_s,
            )
        self.alive = True
        token = self._trio_token
        assert token is not None  # set by run() before the thread starts
        trio.from_thread.run_sync(task_status.started, self.info, trio_token=token)
        times, clock = self.times, time.perf_counter
        while True:
            waited = clock()
            job = self._jobs.get()
            started = clock()
            times.idle_s += started - waited
            if engine.batch_size:
                times.idle_decoding_s += started - waited
            if job is None:
                break
            if job.abandoned:
                continue
            self._current_reply = job.reply
            result = outcome.capture(job.fn, engine)
            self._current_reply = None
            after_row_job(engine, job.kind, self.prompt_cache, self._kv_room)
            times.add(job.kind, clock() - started)
            try:
                token.run_sync_soon(_reply, job.reply, result)
            except trio.RunFinishedError:
                return

    async def _call(self, fn: Callable[[Engine], T], kind: str = "other") -> T:
        if not self.alive:
            raise WorkerDied("the GPU worker is not running")
        reply_send, reply_recv = trio.open_memory_channel[outcome.Outcome](1)
        job = _Job(fn, reply_send, kind)
        with reply_recv:
            self._jobs.put(job)
            try:
                result = await reply_recv.receive()
            except trio.EndOfChannel:
                raise WorkerDied("the GPU worker stopped mid-job") from None
            except BaseException:
                # Cancelled while queued: the job never runs. Once taken it runs to completion
                # (rows leave at step boundaries) and its result is dropped.
                job.abandoned = True
                raise
        value: T = result.unwrap()
        return value

    # -- the Worker interface (actors/worker_api.py) -------------------------------------------

    async def open_row(self, spec: RowSpec) -> RowOpened:
        return await self._call(lambda engine: engine.open_row(mounted_for(engine, spec)), "open_row")

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        return await self._call(lambda engine: engine.prefill(row_id, max_tokens), "prefill")

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]:
        ids = list(row_ids)
        return await self._call(lambda engine: engine.prefill_group(ids), "prefill_group")

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]:
        forks = list(specs)
        return await self._call(
            lambda engine: engine.fork_rows(source_id, [mounted_for(engine, s) for s in forks]), "fork_rows"
        )

    async def join(self, row_id: int) -> TokenOut:
        return await self._call(lambda engine: engine.join(row_id), "join")

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]:
        ids = list(row_ids)
        return await self._call(lambda engine: engine.join_group(ids), "join_group")

    async def step(self) -> list[TokenOut]:
        return await self._call(lambda engine: engine.step(), "step")

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        def job(engine: Engine) -> None:
            if retain_s is not None and self.prompt_cache is not None:
                self.prompt_cache.room = None  # a preempted row's KV moves to the cache (re-capped after)
            engine.close_row(row_id, reusable=reusable, retain_s=retain_s)

        return await self._call(job, "close_row")

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        info = await self._call(lambda engine: engine.mount_adapter(adapter_id, path), "adapter")
        return AdapterReport(**attrs.asdict(info))  # plain values across the thread boundary

    async def unmount_adapter(self, adapter_id: str) -> bool:
        return await self._call(lambda engine: engine.unmount_adapter(adapter_id), "adapter")

    async def embed(self, inputs: list[list[int]], *, dimensions: int | None = None) -> list[list[float]]:
        """Pooled vectors, in order. Inputs of similar length run together, one job per
        `plan_jobs` group, so the scheduler's calls (decode steps) run between a large request's
        jobs instead of waiting for all of it."""
        pooling = self.pooling
        if pooling is None:
            raise NotAnEmbeddingModel("this model is not an embedding model")
        chunk = self.options.engine.prefill_chunk  # long inputs run in prefill's pieces
        vectors: list[list[float]] = [[] for _ in inputs]
        for group in plan_jobs([len(t) for t in inputs]):
            batch = [list(inputs[i]) for i in group]

            def job(engine: Engine, batch: list[list[int]] = batch) -> list[list[float]]:
                from model.engine.embedding import embed

                return embed(engine.model, batch, pooling, dimensions=dimensions, chunk=chunk)

            for index, vector in zip(group, await self._call(job, "embed")):
                vectors[index] = vector
        return vectors

    async def score(self, tokens: list[int], *, top: int = 0, adapters: tuple[str, ...] = ()) -> list[PromptScore]:
        """Prompt logprobs (model/engine/scoring.py): one job on fresh caches (ValueError: cannot)."""
        if self.tp.size > 1:  # (its forwards are mirrored only for rows)
            raise ValueError("prompt logprobs are not served under --tensor-parallel")
        chunk, prompt = self.options.engine.prefill_chunk, list(tokens)

        def job(engine: Engine) -> list[PromptScore]:
            from model.engine.scoring import engine_scores

            return engine_scores(engine, prompt, top=top, adapters=adapters, chunk=chunk)

        return await self._call(job, "score")

    async def machine(self) -> MachineFacts:
        """The device's name and memory bandwidth (model/engine/machine.py), measured once."""

        def job(engine: Engine) -> MachineFacts:
            from model.engine.machine import machine_facts

            return machine_facts()

        if self._machine is None:
            self._machine = await self._call(job, "machine")
        return self._machine

    def abort(self, row_id: int) -> None:
        """The row is leaving: a prefill forward of it running now stops at its next checkpoint
        between layers instead of finishing the chunk (model/engine/prefill_abort.py). Not a job: it
        never waits for the MLX thread. The scheduler still closes the row."""
        self._aborts.add(row_id)

    async def run_exclusive(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the MLX thread between steps (cache maintenance, snapshots)."""
        return await self._call(fn)

    # -- the SSD tier: what durability / demotion need --------------------------------

    def _make_prompt_cache(self, loaded: LoadedModel) -> TieredPromptCache | None:
        """A TieredPromptCache over an opened SsdStore, or None (then the plain RAM tier). An SSD
        tier that cannot open fails start-up, or is a warning with --ssd-optional (actors/ssd/open.py)."""
        if self.ssd_cache_dir is None:
            return None
        from actors.ssd.open import open_ssd_store
        from cache.tiered import TieredPromptCache

        caches = self.options.caches
        store = open_ssd_store(
            self.ssd_cache_dir,
            loaded,
            max_bytes=int(caches.ssd_cache_max_gb * 2**30),
            verify=caches.ssd_verify,
            optional=caches.ssd_optional,
        )
        if store is None:
            return None
        self.ssd_store = store
        cache = TieredPromptCache(0, store, retention_share=caches.cache_retention_share)
        cache.on_put.append(self._forward_put)
        return cache

    def _forward_put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        """PromptCache.put hook, on the MLX thread: hand the mark to trio without waiting."""
        listener, token = self._put_listener, self._trio_token
        if listener is None or token is None:
            return

        def deliver() -> None:
            try:
                listener(namespace, tokens)
            except Exception:  # noqa: BLE001 - a lost mark is a future miss, never a crash
                log.exception("prompt cache put listener failed")

        try:
            token.run_sync_soon(deliver)
        except trio.RunFinishedError:
            pass

    def set_put_listener(self, listener: Callable[[str, tuple[int, ...]], None] | None) -> None:
        """`listener(namespace, tokens)` runs on the trio thread after every prompt-cache put."""
        self._put_listener = listener

    async def snapshot(self, tokens: Sequence[int], namespace: str) -> SpillItem | None:
        """A SpillItem of the RAM entry keyed exactly `tokens`, or None (between steps)."""
        cache, key = self._tier(), tuple(tokens)
        return await self._call(lambda engine: cache.snapshot(key, namespace))

    async def demote_idle(self, idle_s: float) -> list[SpillItem]:
        cache = self._tier()
        return await self._call(lambda engine: cache.demote_idle(idle_s))

    def _tier(self) -> TieredPromptCache:
        if self._tiered is None:
            raise RuntimeError("the worker has no SSD tier")
        return self._tiered

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        store = self.ssd_store
        return store is not None and store.has_durable_prefix(tokens, namespace)

    def close_ssd(self) -> None:
        if self.ssd_store is not None:
            self.ssd_store.close()


def _reply(channel: trio.MemorySendChannel, result: outcome.Outcome) -> None:
    """On the trio thread (run_sync_soon: must not raise)."""
    try:
        channel.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the caller went away (cancelled); the job still ran to completion
