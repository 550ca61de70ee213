"""The process hop of `--isolate` alone: a worker call's round trip between the server and an engine
process, with an engine whose calls cost nothing (so only the hop is timed).

The parent starts `python benchmarks/isolate_hop.py --engine FD` over a socket pair, exactly as
actors/isolate/process.py starts the real engine, and times `step()` through an `IsolatedWorker`'s
link: each step answers ROWS tokens (with `--logprobs`, each with 5 top logprobs). Printed: the
mean and p50/p99 round trip per call, for each ROWS.

Usage: python benchmarks/isolate_hop.py [--calls 3000] [--rows 1,8,32] [--logprobs]
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


def engine(fd: int) -> int:
    from actors.isolate.host import serve_engine
    from actors.options import options

    async def main() -> int:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        return await serve_engine(stream, InstantWorker(), options(), sock=sock)  # type: ignore[arg-type]

    return trio.run(main)


async def measure(args: argparse.Namespace) -> dict:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--engine", str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    ours.setblocking(False)
    link = Link(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), sock=None if args.writer else ours)
    hello = trio.Event()
    link.on_message = lambda head: hello.set()
    results = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        await hello.wait()
        for rows in args.rows:
            await link.call("join", rows * 2 + int(args.logprobs))
            for _ in range(200):  # warm
                await link.call("step")
            times = []
            for _ in range(args.calls):
                started = time.perf_counter()
                await link.call("step")
                times.append(time.perf_counter() - started)
            times.sort()
            results[rows] = {
                "mean_us": round(statistics.fmean(times) * 1e6, 1),
                "p50_us": round(times[len(times) // 2] * 1e6, 1),
                "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
            }
            print(f"rows={rows}: {results[rows]}", file=sys.stderr, flush=True)
        link.post({"stop": True})
        link.close("done")
    child.wait(timeout=10)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--writer", action="store_true", help="the server's frames all through the writer task")
    args = p.parse_args()
    if args.engine is not None:
        sys.exit(engine(args.engine))
    print(json.dumps({"logprobs": args.logprobs, "calls": args.calls, "round_trip": trio.run(measure, args)}))


if __name__ == "__main__":
    main()
