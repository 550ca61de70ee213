"""Rank 0 of `--tensor-parallel N`: start the followers, join MLX's ring, shard, mirror engine calls.

On the GPU worker's MLX thread, once the model is loaded, `TensorParallel.start` writes a ring
hostfile of N localhost ports, starts N-1 `actors.tp.follower` processes (MLX's own rank and
hostfile environment variables, which `mx.distributed.init` reads), joins the ring itself and
shards its model (model/nn/tensor_parallel.py). `wrap` then puts the engine behind `MirroredEngine`:
each engine call in `tp_link.BROADCAST` is sent to every follower before it runs here, and the
followers' acknowledgements are compared with this rank's result. Tokens come from this rank only.

What cannot stay in lockstep is refused or turned off: the prompt cache (its LRU and retention
clocks are per process), the SSD tier, speculative decoding (its policy times steps), embedding
models (their jobs bypass the engine calls), LoRA adapters (they would wrap the sharded layers),
and a prefill's mid-forward abort (a flag set at any moment from the event loop: a row aborted
mid-prefill finishes its chunk and leaves at the call boundary instead).

A follower that dies, stops answering or drifts fails the call in progress (`RankFailed`, its
rows' streams end with an error), every later call, and asks the server to shut down, which exits
1. It never hangs: a lost peer ends a collective with an error, a dead follower is EOF on its pipe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import outcome

from actors.tp.link import BROADCAST, Ack, Call, Setup, Stop, digest, error_text, receive, send
from model.load.errors import ModelLoadError

if TYPE_CHECKING:
    import trio

    from model.engine.engine import Engine
    from model.load.loader import LoadedModel
    from model.options import ServerOptions

log = logging.getLogger(__name__)


class WorkerSettings(Protocol):
    """What start-up reads of the GPU worker (actors/gpu_worker.py)."""

    prompt_cache_on: bool  # (set to False: the prompt cache is off)

    @property
    def options(self) -> ServerOptions: ...
    @property
    def _protected(self) -> frozenset[int]: ...
    @property
    def ssd_cache_dir(self) -> Path | None: ...
    @property
    def speculation(self) -> object | None: ...


START_TIMEOUT_S = 600.0  # followers load the model and join the ring within this
ACK_TIMEOUT_S = 120.0  # after this rank finished a call, each follower's acknowledgement
STOP_TIMEOUT_S = 10.0  # a follower exits this long after Stop, or is killed
_ROOT = Path(__file__).resolve().parents[1]


class RankFailed(RuntimeError):
    """A tensor-parallel rank died, stopped answering or drifted: no engine call can run any more."""

    status = 503


class _Follower:
    def __init__(self, rank: int, hostfile: str) -> None:
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.tp.follower"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=_ROOT,
        )
        self.acks: queue.SimpleQueue[Ack | None] = queue.SimpleQueue()  # None: EOF
        threading.Thread(target=self._read, name=f"tp-rank-{rank}-acks", daemon=True).start()

    def _read(self) -> None:
        stdout = cast(IO[bytes], self.proc.stdout)
        try:
            while True:
                self.acks.put(receive(stdout))
        except (EOFError, OSError, ValueError):
            self.acks.put(None)

    def send(self, message: Any) -> None:
        send(cast(IO[bytes], self.proc.stdin), message)

    def ack(self, timeout: float) -> Ack:
        try:
            ack = self.acks.get(timeout=timeout)
        except queue.Empty:
            raise RankFailed(f"rank {self.rank} did not answer within {timeout:.0f} s") from None
        if ack is None:
            self.proc.wait()
            raise RankFailed(f"rank {self.rank} exited (code {self.proc.returncode})")
        return ack

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(Stop())
                cast(IO[bytes], self.proc.stdin).close()
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop: killing it", self.rank)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class TensorParallel:
    """The GPU worker's tensor-parallel state (size 1: nothing to do; every method is a no-op)."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self.failed: str | None = None  # why the ranks can no longer run (the server then exits 1)
        self.on_failure: Callable[[], None] | None = None  # on the trio thread (serve.py: shutdown)
        self._followers: list[_Follower] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._hostfile: str | None = None

    # -- start-up, on the MLX thread --------------------------------------------------------

    def start(self, worker: WorkerSettings, loaded: LoadedModel, eos: frozenset[int], token: Any) -> None:
        if self.size == 1:
            return
        from model.nn.tensor_parallel import check_shardable

        self._token = token
        _refuse_unmirrored(worker, loaded)
        try:
            check_shardable(loaded.model, self.size)
        except ValueError as e:
            raise ModelLoadError(f"--tensor-parallel {self.size}: {e}") from None
        if worker.prompt_cache_on:
            log.warning("--tensor-parallel: the prompt cache is off (its ranks' caches could not stay in lockstep)")
            worker.prompt_cache_on = False
        options = worker.options
        setup = Setup(str(loaded.path), options.engine, eos, worker._protected, options.kv)
        try:
            self._launch(setup, loaded)
        except BaseException:
            self.close()
            raise
        log.info(
            "tensor parallel over %d ranks (ring, localhost): KV %d bytes per token per rank (1/%d of the model's)",
            self.size,
            loaded.kv_bytes_per_token,
            self.size,
        )

    def _launch(self, setup: Setup, loaded: LoadedModel) -> None:
        import mlx.core as mx

        from model.load.weights import parameter_bytes
        from model.nn.tensor_parallel import shard_model

        fd, self._hostfile = tempfile.mkstemp(prefix="mlx-trio-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{port}"] for port in _free_ports(self.size)], f)
        self._followers = [_Follower(rank, self._hostfile) for rank in range(1, self.size)]
        for follower in self._followers:
            follower.send(setup)
        # MLX reads this rank's place in the ring from the environment, like the followers'.
        os.environ.update({"MLX_RANK": "0", "MLX_HOSTFILE": self._hostfile})
        joined: list[Any] = []
        # init blocks until every rank has connected: in a thread of its own, so a follower that
        # dies before joining fails start-up instead of hanging it.
        threading.Thread(
            target=lambda: joined.append(outcome.capture(mx.distributed.init, True, "ring")), daemon=True
        ).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not joined:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ModelLoadError(
                    f"--tensor-parallel: the ranks did not join the ring within {START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)
        group = joined[0].unwrap()
        shard_model(loaded.model, group)  # type: ignore[arg-type]  # (checked: a DecoderModel)
        loaded.weights_bytes = parameter_bytes(loaded.model)  # this rank's share
        for follower in self._followers:
            ack = follower.ack(max(1.0, deadline - time.monotonic()))
            if not ack.ok:
                raise ModelLoadError(f"--tensor-parallel: rank {follower.rank} failed to start: {ack.error}")

    def _check_alive(self) -> None:
        for follower in self._followers:
            if follower.proc.poll() is not None:
                raise ModelLoadError(
                    f"--tensor-parallel: rank {follower.rank} exited (code {follower.proc.returncode}) before joining"
                )

    def wrap(self, engine: Engine) -> Engine:
        return engine if self.size == 1 else cast("Engine", MirroredEngine(engine, self))

    # -- serving ------------------------------------------------------------------------------

    def call(self, method: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` here and the same call on every follower; the result is this rank's."""
        if self.failed is not None:
            raise RankFailed(self.failed)
        try:
            for follower in self._followers:
                follower.send(Call(method, args, tuple(kwargs.items())))
        except (OSError, ValueError) as e:
            self._fail(f"rank {follower.rank}: control pipe closed ({e})")
        result = outcome.capture(fn, *args, **kwargs)
        mine = (
            Ack(True, digest(result.value))
            if isinstance(result, outcome.Value)
            else Ack(False, error=error_text(result.error))
        )
        try:
            for follower in self._followers:
                theirs = follower.ack(ACK_TIMEOUT_S)
                if theirs != mine:
                    self._fail(f"rank {follower.rank} drifted at {method}: {theirs} (rank 0: {mine})")
        except RankFailed as e:
            self._fail(str(e))
        return result.unwrap()  # an error both ranks raised is the call's own (a bad row id, say)

    def _fail(self, why: str) -> None:
        """Stop the ranks for good and ask the server to shut down; raises `RankFailed`."""
        if self.failed is None:
            self.failed = why
            log.error("tensor parallel failed: %s; shutting down", why)
            for follower in self._followers:
                if follower.proc.poll() is None:
                    follower.proc.kill()
            if self.on_failure is not None and self._token is not None:
                try:
                    self._token.run_sync_soon(self.on_failure)
                except RuntimeError:  # trio.RunFinishedError: the server is already going
                    pass
        raise RankFailed(self.failed)

    def close(self) -> None:
        """Stop every follower (Stop, then kill after a grace period); on the worker's way out."""
        for follower in self._followers:
            follower.stop()
        self._followers = []
        if self._hostfile is not None:
            Path(self._hostfile).unlink(missing_ok=True)
            self._hostfile = None


class MirroredEngine:
    """The engine with its row calls mirrored to the followers; everything else reads through."""

    def __init__(self, engine: Engine, tp: TensorParallel) -> None:
        self._engine = engine
        self._tp = tp

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if name in BROADCAST:
            return partial(self._tp.call, name, value)
        if name in ("mount_adapter", "unmount_adapter"):
            raise ValueError("LoRA adapters are not supported with --tensor-parallel")
        return value


def _refuse_unmirrored(worker: WorkerSettings, loaded: LoadedModel) -> None:
    if loaded.pooling is not None:
        raise ModelLoadError("--tensor-parallel does not serve embedding models")
    if worker.ssd_cache_dir is not None:
        raise ModelLoadError("--tensor-parallel cannot be combined with --ssd-cache")
    if worker.speculation is not None:
        raise ModelLoadError(
            "--tensor-parallel cannot be combined with speculative decoding (--draft-model/--draft-kind)"
        )


def _free_ports(n: int) -> list[int]:
    """n distinct free localhost ports (held open together while chosen, so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def rank_failed(worker: object) -> bool:
    """Whether a tensor-parallel rank failed while serving (serve.py's exit code)."""
    tp = getattr(worker, "tp", None)
    return isinstance(tp, TensorParallel) and tp.failed is not None


def on_rank_failure(worker: object, callback: Callable[[], None]) -> None:
    """Run `callback` on the trio thread when a rank fails (serve.py: start the shutdown)."""
    tp = getattr(worker, "tp", None)
    if isinstance(tp, TensorParallel):
        tp.on_failure = callback
