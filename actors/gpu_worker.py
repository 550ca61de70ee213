"""GPU-worker actor: one model's engine on the MLX thread.

Inbound: job calls from the scheduler (`open_row`, `prefill`, `prefill_group`, `fork_rows`, `join`,
`join_group`, `step`, `close_row`), from the embeddings route (`embed`: jobs of its own between
those calls), /v1/completions' prompt logprobs (`score`, the same), the SSD tier (`run_exclusive`,
`snapshot`, `demote_idle`, `demote_all`): each an awaited method that puts a job on the MLX
thread's queue (actors/mlx_thread.py). Outbound: each job's result (or exception) on that job's
reply channel; with the SSD tier, every prompt-cache put is posted to the put listener
(durability's `MarkDirty`).

The worker loads its model on the MLX thread (MLX arrays, weights included, are bound to the
thread that created them) and then runs jobs there one at a time. Alone (the default), it starts
that thread itself and the thread ends with it. In a model pool (actors/pool.py) it is handed the
server's one `MlxThread`, shared with every other resident model's worker: its load is one job
there, and when its task is cancelled its engine is dropped by one more (`unload`), so the model's
memory goes back while the thread serves the others. A job is never interrupted, so rows always
leave at step boundaries. The one early end is a prefill's own: `abort(row_id)` (not a job) flags
the row, and a prefill forward of it stops at its next check between layers
(model/engine/prefill_abort.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs
import trio

from actors.adapter_registry import mounted_for
from actors.kv_memory import buffer_cache_bytes
from actors.mlx_thread import MlxThread, WorkerDied, WorkerTimes
from actors.options import resolve
from actors.tp.leader import TensorParallel
from actors.worker_api import AdapterReport, ModelInfo, NotAnEmbeddingModel, kv_fields, loaded_fields
from actors.worker_memory import after_row_job, device_memory_bytes
from model import prefill_dequant
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

__all__ = ["GpuWorker", "WorkerDied", "WorkerTimes"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class GpuWorker:
    def __init__(
        self,
        model_dir: Path,
        options: ServerOptions,
        *,
        name: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        protected_ids: Iterable[int] = (),
        thread: MlxThread | None = None,
    ) -> None:
        """The worker for `model_dir`, built as `options` say (the groups it reads: engine, kv,
        speculation, caches; `--batch` and `--warm-up` through `actors.options.resolve`), on
        `thread` (shared, started by its owner) or on a thread of its own. Raises ModelLoadError
        when --draft-model does not resolve."""
        self.model_dir = Path(model_dir)
        self.options = options
        self.speculation = spec_choice(options.speculation)  # built into the engine once the target loads
        self.tp = TensorParallel(options.engine.tensor_parallel)  # --tensor-parallel: actors/tp/leader.py
        self._own_thread = thread is None
        self.thread = MlxThread() if thread is None else thread
        self.name = name
        self._eos = None if eos_token_ids is None else frozenset(eos_token_ids)
        self._protected = frozenset(protected_ids)
        caches = options.caches
        # Off only when --prompt-cache 0 or under tensor parallelism; sized once the model is loaded.
        self.prompt_cache_on = caches.prompt_cache_gb != 0
        self.prompt_cache_bytes = self._kv_room = self._room = 0  # (_kv_room: what rows and the cache share)
        # Read from the trio side for /stats: plain ints only, so no lock is needed.
        self.prompt_cache: PromptCache | None = None
        self._tiered: TieredPromptCache | None = None
        # SSD tier: built on the MLX thread with the RAM tier; None when off or unusable.
        self.ssd_cache_dir = None if caches.ssd_cache_dir is None else Path(caches.ssd_cache_dir)
        self.ssd_store: SsdStore | None = None
        self._put_listener: Callable[[str, tuple[int, ...]], None] | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.alive = False
        self.info: ModelInfo | None = None
        self._engine: Engine | None = None
        # Rows being aborted: written here from the trio thread, read by a running prefill.
        self._aborts = AbortFlags()
        self.pooling: Pooling | None = None  # an embedding model's, once loaded
        self._machine: MachineFacts | None = None  # measured on the first GET /fit

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward (the root sizes group prefills by it)."""
        return self.options.engine.prefill_chunk

    @property
    def times(self) -> WorkerTimes:
        return self.thread.times

    @property
    def thread_ident(self) -> int | None:
        return self.thread.thread_ident

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model on the MLX thread (starting it when it is the worker's own), serve
        until cancelled, then drop the engine (a shared thread goes on serving the others)."""
        self._trio_token = trio.lowlevel.current_trio_token()
        try:
            if self._own_thread:
                self.thread.on_exit.append(self.tp.close)  # the followers stop with this rank's MLX thread
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.thread.run)
                    await self._serve(task_status)
            else:
                await self._serve(task_status)
        finally:
            self.alive = False
            self.close_ssd()  # releases the SSD directory lock (a writer may still finish)

    async def _serve(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        self.thread.decoding.append(self._decoding)
        try:
            info = await self.thread.call(self._load, "load")
            self.alive = True
            task_status.started(info)
            await trio.sleep_forever()
        finally:
            self.alive = False
            self.thread.decoding.remove(self._decoding)
            if not self._own_thread and self.thread.alive:
                with trio.CancelScope(shield=True):
                    try:
                        await self.thread.call(self._unload, "unload")
                    except WorkerDied:
                        pass

    def _decoding(self) -> bool:
        """On the MLX thread: whether this model's engine has rows decoding."""
        engine = self._engine
        return engine is not None and bool(engine.batch_size)

    def _load(self) -> ModelInfo:
        # Everything MLX is imported and created here, on the MLX thread only.
        import mlx.core as mx

        from cache.prompt_cache import PromptCache
        from model.engine.build import build_engine, eos_of, kv_scheme_for
        from model.kv.rows import resumable
        from model.load.loader import load_model

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
            )
            + prefill_dequant.transient_bytes(),  # CUDA: a batch prefill's dequantized weights, where on
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
        self._room = self._kv_room = resolved.kv_room_bytes
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
        self._engine = engine
        return self.info

    def _unload(self) -> None:
        """On the MLX thread: drop the engine, its caches and weights; give the memory back."""
        import mlx.core as mx

        self._engine = None
        if self.prompt_cache is not None:  # (the app's handles of the model's first load still name it)
            self.prompt_cache.clear()
        self.prompt_cache = self._tiered = None
        self.pooling = None  # (an embedding model's pooling layers hold weights)
        gc.collect()  # (the model's modules hold reference cycles)
        mx.clear_cache()

    def set_other_weights(self, nbytes: int) -> None:
        """Other resident models hold `nbytes` of weights in the same memory budget (actors/pool.py):
        the room this model's rows and prompt cache share shrinks by as much."""
        self._kv_room = max(0, self._room - nbytes)

    async def _call(self, fn: Callable[[Engine], T], kind: str = "other") -> T:
        if not self.alive:
            raise WorkerDied("the GPU worker is not running")

        def job() -> T:
            engine = self._engine
            if engine is None:
                raise WorkerDied("the model was unloaded")
            return fn(engine)

        def after() -> None:
            engine = self._engine
            if engine is not None:
                after_row_job(engine, kind, self.prompt_cache, self._kv_room)

        return await self.thread.call(job, kind, after)

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

    async def demote_all(self) -> list[SpillItem]:
        """Every RAM prompt-cache entry leaves RAM; the ones the SSD lacks come back to be written."""
        cache = self._tier()
        return await self._call(lambda engine: cache.demote_all())

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
