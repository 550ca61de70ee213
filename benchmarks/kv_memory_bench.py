"""GPU memory under load, ours vs mlx_lm.server: held at ready, right after a burst of concurrent
requests, and after the server has idled; with --agents, long-context agents whose KV together
exceeds the card (every request's status, aggregate tok/s, our preemptions).

Each server runs alone (one at a time), with no flags unless given; memory is what nvidia-smi
reports for the server's processes. Prints one JSON line per server and writes them to --out.

  python benchmarks/kv_memory_bench.py --model DIR --burst 32 --prompt-words 200 --max-tokens 128
  python benchmarks/kv_memory_bench.py --model DIR --burst 32 --prompt-words 12000 --max-tokens 256 \\
      --kinds ours,mlx_lm --limit 240
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_bench import Server, free_port, stream_chat, text_of  # noqa: E402


def gpu_mib(pids: set[int]) -> int:
    """MiB nvidia-smi reports for these processes (the server and its children)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    total = 0
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            total += int(used.strip() or 0)
    return total


def tree(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=False).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = {pid}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


async def one(client: httpx.AsyncClient, server: Server, i: int, words: int, max_tokens: int) -> dict:
    messages = [{"role": "user", "content": f"agent {i}: " + text_of(words, i)}]
    try:
        r = await stream_chat(client, server, messages, max_tokens)
        return {"ok": True, "tokens": r["tokens"], "ttft": r["ttft"]}
    except Exception as exc:  # noqa: BLE001 - a failed request is a result here
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


async def burst(server: Server, n: int, words: int, max_tokens: int, limit: float) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(client, server, i, words, max_tokens)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - t0
    results = [t.result() for t in done if not t.cancelled()]
    ok = [r for r in results if r["ok"]]
    return {
        "requests": n,
        "finished": len(ok),
        "failed": len(results) - len(ok),
        "unfinished_at_limit": len(pending),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "wall_s": round(wall, 2),
        "agg_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        # tokens per request: equal work for both servers only if these match
        "tokens": sorted(r["tokens"] for r in ok),
    }


def run(kind: str, model: Path, args: argparse.Namespace) -> dict:
    extra = args.ours_flags.split() if kind == "ours" else args.mlx_lm_flags.split()
    out: dict = {"server": kind, "flags": extra}
    with Server(kind, model, free_port(), extra) as server:
        assert server.proc is not None
        out["start_s"] = round(server.start_s, 1)
        time.sleep(2)
        pids = tree(server.proc.pid)
        out["ready_mib"] = gpu_mib(pids)
        out["burst"] = asyncio.run(burst(server, args.burst, args.prompt_words, args.max_tokens, args.limit))
        pids = tree(server.proc.pid)
        out["after_burst_mib"] = gpu_mib(pids)
        alive = server.proc.poll() is None
        out["alive_after_burst"] = alive
        if alive:
            time.sleep(args.idle)
            out["after_idle_mib"] = gpu_mib(pids)
            if kind == "ours":
                try:
                    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
                    keys = ("preemptions", "resumes", "peak_kv_bytes", "kv_budget_bytes", "configured")
                    out["stats"] = {k: stats["batch"].get(k) for k in keys}
                    out["stats"]["prompt_cache"] = stats.get("prompt_cache")
                    out["stats"]["memory_budget_bytes"] = stats["admission"]["memory_budget_bytes"]
                    # MLX's allocator at idle: what of after_idle_mib is MLX's (arrays, cached buffers)
                    out["stats"]["mlx_memory"] = stats.get("worker", {}).get("memory")
                except Exception as exc:  # noqa: BLE001
                    out["stats_error"] = str(exc)
        else:
            out["tail"] = server.tail(1500)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--kinds", default="ours,mlx_lm")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--idle", type=float, default=10.0)
    p.add_argument("--limit", type=float, default=240.0, help="seconds the burst may take")
    p.add_argument("--ours-flags", default="")
    p.add_argument("--mlx-lm-flags", default="")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results = []
    for kind in args.kinds.split(","):
        try:
            result = run(kind, args.model, args)
        except Exception as exc:  # noqa: BLE001 - a server that cannot start is a result too
            result = {"server": kind, "error": str(exc)[-1500:]}
        print(json.dumps(result), flush=True)
        results.append(result)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
