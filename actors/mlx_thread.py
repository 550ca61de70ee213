"""The one OS thread every MLX object lives on, and the job queue that feeds it.

MLX arrays (weights included) are bound to the thread that created them, so the server runs all
MLX work on one dedicated thread: each GPU worker (actors/gpu_worker.py, one per resident model)
puts its calls here as jobs, and the thread runs them one at a time, in arrival order. With a
model pool (actors/pool.py) several workers share one thread: their schedulers' calls interleave
job by job, so no model's batch waits for another's whole generation, and no two MLX calls ever
run at once.

Neither direction makes the MLX thread wait for the trio thread: jobs arrive on a thread-safe
queue (the thread blocks on it with the GIL released) and replies are posted with
`run_sync_soon`. Under load the trio thread is busy with every stream's per-token work; a
blocking hand-off (`trio.from_thread.run`) would idle the device until the event loop came round.

A job is never interrupted: a caller that is cancelled while waiting merely stops listening, and
the job's result is dropped; one cancelled while its job is still queued skips it.

An isolated engine's host (actors/isolate/host.py) also hands its result on from the MLX thread:
a call made with `ON_THREAD` set gives the job that callback, run there once the job (and its
`after`) has run, before the reply to the caller is posted. It writes the call's answer to the
server's socket at once, so the answer does not wait for the engine process's event loop to wake.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import attrs
import outcome
import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

# Set by a caller (for the calls it makes from its task): each job also hands its result to this,
# on the MLX thread (it must not raise, nor block for long).
ON_THREAD: ContextVar[Callable[[outcome.Outcome], None] | None] = ContextVar("on_thread", default=None)

# After this long without a job (following some work) the thread hands MLX's buffer cache back to
# the device: buffers freed after the last row job (a prompt-cache insert, a stream's last
# tokens, a snapshot) would otherwise stay cached while the server idles.
IDLE_RELEASE_S = 1.0


class WorkerDied(RuntimeError):
    """The MLX thread (or the model's engine on it) is gone; no MLX work can run any more."""


@attrs.define(eq=False)
class _Job:
    fn: Callable[[], Any]
    reply: trio.MemorySendChannel
    kind: str = "other"  # what /stats counts its time under
    after: Callable[[], None] | None = None  # the caller's housekeeping once the job has run
    abandoned: bool = False  # its caller was cancelled before the thread took it: skip it
    on_thread: Callable[[outcome.Outcome], None] | None = None  # (ON_THREAD's, when the call was made)


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
    # MLX's allocator after the latest job or idle release: active / cached / peak bytes.
    memory: dict[str, int] = attrs.Factory(dict)
    idle_releases: int = 0  # times the buffer cache went back to the device at idle

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
            "memory": dict(self.memory),
            "idle_releases": self.idle_releases,
        }


class MlxThread:
    """The dedicated MLX thread as an actor: `run` owns its life, `call` runs one job on it."""

    def __init__(self, name: str = "mlx-gpu-worker") -> None:
        self.name = name
        self.times = WorkerTimes()
        self.alive = False
        self.thread_ident: int | None = None
        self.trio_token: trio.lowlevel.TrioToken | None = None
        # Probes run on the thread between jobs: does some engine have rows decoding (idle_decoding_s)?
        self.decoding: list[Callable[[], bool]] = []
        # Run on the thread as it ends, before MLX drops its streams (tensor parallel's followers).
        self.on_exit: list[Callable[[], None]] = []
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None ends the loop
        self._current_reply: trio.MemorySendChannel | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the thread; it serves jobs until this task is cancelled (a job already running
        finishes first). An exception on the thread ends the thread and is raised here."""
        self.trio_token = token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        ended: list[outcome.Outcome] = []

        def body() -> None:
            self.thread_ident = threading.get_ident()
            ended.append(outcome.capture(self._loop, token))
            for hook in self.on_exit:
                try:
                    hook()
                except Exception:
                    log.exception("MLX thread exit hook failed")
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
        thread = threading.Thread(target=body, name=self.name)
        self.alive = True
        thread.start()
        try:
            task_status.started()
            try:
                await finished.wait()
            finally:
                # End the job loop; a job already running finishes first (rows leave at step
                # boundaries), so wait for the thread, shielded.
                self._jobs.put(None)
                with trio.CancelScope(shield=True):
                    await finished.wait()
                thread.join()
            ended[0].unwrap()
        finally:
            self.alive = False
            if self._current_reply is not None:
                self._current_reply.close()  # a caller mid-job sees WorkerDied, not a hang
            while True:  # and so does one whose job was still queued
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.reply.close()

    def _loop(self, token: trio.lowlevel.TrioToken) -> None:
        import mlx.core as mx

        times, clock = self.times, time.perf_counter
        worked = False  # a job ran since the last idle release
        while True:
            waited = clock()
            try:
                job = self._jobs.get(timeout=IDLE_RELEASE_S) if worked else self._jobs.get()
            except queue.Empty:
                times.idle_s += clock() - waited
                worked = False
                mx.clear_cache()
                # On CUDA the freed buffers go back to the driver's stream-ordered pool, which
                # hands them to the device only at a synchronization: without one an idle
                # server keeps its last burst's memory reserved.
                mx.synchronize()
                times.idle_releases += 1
                times.memory = allocator_bytes(mx)
                continue
            started = clock()
            times.idle_s += started - waited
            if any(probe() for probe in self.decoding):
                times.idle_decoding_s += started - waited
            if job is None:
                break
            if job.abandoned:
                continue
            self._current_reply = job.reply
            result = outcome.capture(job.fn)
            self._current_reply = None
            if job.after is not None:
                job.after()
            if job.on_thread is not None:
                try:
                    job.on_thread(result)
                except Exception:
                    log.exception("a job's result hand-off failed")
            times.add(job.kind, clock() - started)
            times.memory = allocator_bytes(mx)
            worked = True
            try:
                token.run_sync_soon(_reply, job.reply, result)
            except trio.RunFinishedError:
                return

    async def call(self, fn: Callable[[], T], kind: str = "other", after: Callable[[], None] | None = None) -> T:
        """`fn()` on the MLX thread, then `after()` there too; its result or exception here."""
        if not self.alive:
            raise WorkerDied("the GPU worker is not running")
        reply_send, reply_recv = trio.open_memory_channel[outcome.Outcome](1)
        job = _Job(fn, reply_send, kind, after, on_thread=ON_THREAD.get())
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


def _reply(channel: trio.MemorySendChannel, result: outcome.Outcome) -> None:
    """On the trio thread (run_sync_soon: must not raise)."""
    try:
        channel.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the caller went away (cancelled); the job still ran to completion


def allocator_bytes(mx: Any) -> dict[str, int]:
    """What MLX's allocator holds: arrays alive, freed buffers kept for reuse, the peak."""
    return {
        "active_bytes": int(mx.get_active_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
    }
