"""The process hop of `--isolate` alone: a worker call's round trip between the server and an engine
process, with an engine whose calls cost nothing (so only the hop is timed).

The parent starts `python benchmarks/isolate_hop.py --engine FD` over a socket pair, exactly as
actors/isolate/process.py starts the real engine, and times `step()` through an `IsolatedWorker`'s
link: each step answers ROWS tokens (with `--logprobs`, each with 5 top logprobs). Printed: the
mean and p50/p99 round trip per call, for each ROWS.

With `--mlx-thread` the engine runs each step as a job on an `MlxThread` (actors/mlx_thread.py), as
the GPU worker does, and the same worker is also timed in this process (`in_process`): the
difference is what isolation adds to a decode step. `--job-us N`: each job takes N us (a sleep,
the GIL released, as a forward's evaluation does), so the event loops are asleep when it ends, as
they are after a real step.

Usage: python benchmarks/isolate_hop.py [--calls 3000] [--rows 1,8,32] [--logprobs] [--mlx-thread [--job-us N]]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors.isolate.link import Link  # noqa: E402
from actors.mlx_thread import MlxThread  # noqa: E402
from actors.worker_api import ModelInfo  # noqa: E402
from model.engine.rows import TokenOut, TopLogprob  # noqa: E402


class InstantWorker:
    """Answers every step with `rows` tokens at once."""

    def __init__(self) -> None:
        self.rows = 1
        self.logprobs = False
        self.info = ModelInfo(
            name="hop", context_length=8, weights_bytes=0, kv_bytes_per_token=0, eos_token_ids=frozenset()
        )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self.info)
        await trio.sleep_forever()

    async def step(self) -> list[TokenOut]:
        top = tuple(TopLogprob(1000 + k, -1.5 - k) for k in range(5)) if self.logprobs else ()
        return [TokenOut(i, 12345 + i, None, -0.5 if self.logprobs else None, top) for i in range(self.rows)]

    async def join(self, row_id: int) -> list[int]:  # (reused as "set the shape": rows, logprobs)
        self.rows, self.logprobs = row_id // 2, bool(row_id % 2)
        return []

    def abort(self, row_id: int) -> None:
        pass


class ThreadWorker(InstantWorker):
    """Its steps are jobs on an MLX thread of its own, as actors/gpu_worker.py's are."""

    def __init__(self, job_s: float = 0.0) -> None:
        super().__init__()
        self.thread = MlxThread("hop-mlx")
        self.job_s = job_s

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.thread.run)
            task_status.started(self.info)
            await trio.sleep_forever()

    async def step(self) -> list[TokenOut]:
        tokens, job_s = await InstantWorker.step(self), self.job_s

        def job() -> list[TokenOut]:
            if job_s:
                time.sleep(job_s)  # (the GIL released, as a forward's evaluation does)
            return tokens

        return await self.thread.call(job, "step")


def engine(fd: int, mlx_thread: bool, job_s: float) -> int:
    from actors.isolate.host import serve_engine
    from actors.options import options

    async def main() -> int:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        worker = ThreadWorker(job_s) if mlx_thread else InstantWorker()
        return await serve_engine(stream, worker, options(), sock=sock)  # type: ignore[arg-type]

    return trio.run(main)


async def measure(args: argparse.Namespace) -> dict:
    ours, theirs = socket.socketpair()
    command = [sys.executable, __file__, "--engine", str(theirs.fileno())] + ["--mlx-thread"] * args.mlx_thread
    command += ["--job-us", str(args.job_us)]
    child = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
    theirs.close()
    ours.setblocking(False)
    link = Link(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), sock=None if args.writer else ours)
    hello = trio.Event()
    link.on_message = lambda head: hello.set()
    results = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        await hello.wait()
        local = ThreadWorker(args.job_us / 1e6) if args.mlx_thread else None
        if local is not None:
            await nursery.start(local.run)
        for rows in args.rows:
            await link.call("join", rows * 2 + int(args.logprobs))
            results[rows] = await timed(lambda: link.call("step"), args.calls)
            if local is not None:
                await local.join(rows * 2 + int(args.logprobs))
                results[rows]["in_process"] = await timed(local.step, args.calls)
            print(f"rows={rows}: {results[rows]}", file=sys.stderr, flush=True)
        link.post({"stop": True})
        link.close("done")
        nursery.cancel_scope.cancel()
    child.wait(timeout=10)
    return results


async def timed(step, calls: int) -> dict:
    for _ in range(200):  # warm
        await step()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await step()
        times.append(time.perf_counter() - started)
    times.sort()
    return {
        "mean_us": round(statistics.fmean(times) * 1e6, 1),
        "p50_us": round(times[len(times) // 2] * 1e6, 1),
        "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--writer", action="store_true", help="the server's frames all through the writer task")
    p.add_argument("--mlx-thread", action="store_true", help="each step a job on an MLX thread, also timed in process")
    p.add_argument("--job-us", type=int, default=0, help="with --mlx-thread: each step's job takes this long")
    args = p.parse_args()
    if args.engine is not None:
        sys.exit(engine(args.engine, args.mlx_thread, args.job_us / 1e6))
    round_trip = trio.run(measure, args)
    print(
        json.dumps(
            {"logprobs": args.logprobs, "mlx_thread": args.mlx_thread, "calls": args.calls, "round_trip": round_trip}
        )
    )


if __name__ == "__main__":
    main()
