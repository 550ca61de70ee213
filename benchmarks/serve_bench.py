"""Side-by-side serving benchmark: our server vs mlx_lm.server on the same model directory.

Starts each server as a subprocess (one at a time, so they never share the machine), drives the
same OpenAI streaming workloads through HTTP, and prints a markdown table of ratios (ours /
mlx_lm) plus JSON (and PNG plots with --plots DIR). Workloads:
  cN      N concurrent streams (default 1, 8 and 32): aggregate output tok/s, per-stream decode
          tok/s, TTFT p50/p99, ITL p50/p99
  agent   multi-turn conversations sharing a long system prompt: turn-1 vs turn-N TTFT
  joiner  a long-prompt request joins running streams: their max ITL while it prefills
  abort   (ours only: needs /stats) client disconnects during decode and during prefill: seconds
          and decode steps / prefill chunks until the row has left the batch
  exit    SIGINT with N streams in flight: seconds until the process is gone
  restart (--restart-words N) one long prompt's TTFT on a fresh server, then after a restart
          (ours with --ssd-cache in a temp dir; mlx_lm.server keeps nothing)

Both servers get greedy decoding, the same max_tokens, and a batch as wide as the largest
concurrency (ours: --batch N; mlx_lm.server: --decode-concurrency N, its default 32), unless
--no-flags starts both with their defaults (the out-of-the-box comparison).

Usage:
  python benchmarks/serve_bench.py --model DIR
  python benchmarks/serve_bench.py --synth qwen3-0.6b --dtype bfloat16      # random weights, real shape
  python benchmarks/serve_bench.py --synth cpu-small --dtype float32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.synth_fast import SHAPES, fast_model_dir  # noqa: E402

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()

MODEL_NAME = {"ours": "default_model", "mlx_lm": "default_model"}  # both map "default_model" to --model


def text_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + (i * i) % 5) % len(WORDS)] for i in range(n_words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    # Where each server's output goes: a file in this folder, named by kind and port, kept after
    # the run (`--server-logs`); None: a temporary file, gone with the process.
    log_dir: Path | None = None

    def __init__(
        self,
        kind: str,
        model: Path,
        port: int,
        extra: list[str],
        switch_interval: float | None = None,
        profile_out: Path | None = None,
    ):
        self.kind, self.port = kind, port
        if kind == "ours" and switch_interval:
            boot = (
                f"import sys, runpy; sys.setswitchinterval({switch_interval}); "
                "sys.argv = ['actors.serve'] + sys.argv[1:]; runpy.run_module('actors.serve', run_name='__main__')"
            )
            cmd = [sys.executable, "-c", boot, "--model", str(model), "--port", str(port), *extra]
        elif kind == "ours" and profile_out:
            cmd = [
                sys.executable,
                str(ROOT / "benchmarks" / "profile_serve.py"),
                "--out",
                str(profile_out),
                "--",
                "--model",
                str(model),
                "--port",
                str(port),
                *extra,
            ]
        elif kind == "ours":
            cmd = [sys.executable, "-m", "actors.serve", "--model", str(model), "--port", str(port), *extra]
        elif kind == "mlx_lm+blas":  # mlx_lm.server with the BLAS our server preloads (CPU fairness)
            boot = (
                "import sys; from model.load.blas import preload_optimized_blas; preload_optimized_blas(); "
                "import runpy; sys.argv = ['mlx_lm'] + sys.argv[1:]; runpy.run_module('mlx_lm', run_name='__main__')"
            )
            cmd = [sys.executable, "-c", boot, "server", "--model", str(model), "--port", str(port), *extra]
        else:
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port), *extra]
        self.cmd = cmd
        self.model_name = MODEL_NAME[kind.split("+")[0]]
        self.proc: subprocess.Popen | None = None
        self.start_s = float("nan")

    def __enter__(self) -> Server:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(self.log_dir / f"{self.kind}-{self.port}.log", "w+b")  # (open while the server runs)
        else:
            self.log = tempfile.TemporaryFile()
        t0 = time.perf_counter()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.kind} server did not become healthy")

    def tail(self, n: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> float:
        """SIGINT and wait; returns seconds to exit."""
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.perf_counter() - t0

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.stop()


async def stream_chat(
    client: httpx.AsyncClient,
    server: Server,
    messages: list[dict],
    max_tokens: int,
    *,
    stop_after: int | None = None,
    stamps: list[float] | None = None,
) -> dict:
    """One streaming chat completion; `stop_after` tokens → disconnect (returns at once).
    `stamps` (optional) receives each content chunk's arrival time as it comes."""
    body = {
        "model": server.model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps = [] if stamps is None else stamps
    text: list[str] = []
    usage = None
    async with _connect(client, server, body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
            if stop_after is not None and len(stamps) >= stop_after:
                break
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(stamps)
    return {
        "ttft": (stamps[0] - t0) if stamps else end - t0,
        "stamps": stamps,
        "start": t0,
        "end": end,
        "tokens": tokens,
        "text": "".join(text),
        "usage": usage,
    }


@contextlib.asynccontextmanager
async def _connect(client: httpx.AsyncClient, server: Server, body: dict):
    """POST and open the stream, retrying refused/reset connections (mlx_lm.server's listen
    backlog is socketserver's default of 5, so a burst of 32 connects gets some reset); the
    caller's clock keeps running, so the wait counts against the server's TTFT."""
    for attempt in range(200):
        opened = False
        try:
            async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")[:500]
                    raise RuntimeError(f"{server.kind}: HTTP {r.status_code}: {detail}")
                opened = True
                yield r
                return
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if opened or attempt == 199:
                raise
            await asyncio.sleep(0.02)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def warm(client: httpx.AsyncClient, server: Server) -> None:
    for i in range(2):
        await stream_chat(client, server, [{"role": "user", "content": f"warm up {i}"}], 8)


async def concurrent(server: Server, c: int, max_tokens: int, prompt_words: int, seed: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        await warm(client, server)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[
                stream_chat(
                    client,
                    server,
                    [{"role": "user", "content": f"{seed}.{i} " + text_of(prompt_words, seed + i)}],
                    max_tokens,
                )
                for i in range(c)
            ]
        )
        wall = time.perf_counter() - t0
    itls = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    total = sum(r["tokens"] for r in results)
    decode_rates = [
        (len(r["stamps"]) - 1) / (r["stamps"][-1] - r["stamps"][0])
        for r in results
        if len(r["stamps"]) > 1 and r["stamps"][-1] > r["stamps"][0]
    ]
    return {
        "concurrency": c,
        **steady_decode(results),
        "wall_s": wall,
        "tokens": total,
        "agg_tok_s": total / wall,
        "ttft_p50": pct([r["ttft"] for r in results], 0.5),
        "ttft_p99": pct([r["ttft"] for r in results], 0.99),
        "itl_p50": pct(itls, 0.5),
        "itl_p99": pct(itls, 0.99),
        "per_stream_tok_s": statistics.mean(decode_rates) if decode_rates else 0.0,
        "ttfts": [r["ttft"] for r in results],
        "itls": itls,
    }


def steady_decode(results: list[dict]) -> dict:
    """Decode with every stream running: from the last stream's first token to the first
    stream's last, the tokens all streams produced per second and their ITL p50 (a window
    without any prefill of this batch; absent when the streams never all ran together)."""
    firsts = [r["stamps"][0] for r in results if r["stamps"]]
    lasts = [r["stamps"][-1] for r in results if r["stamps"]]
    if len(firsts) < len(results) or not firsts or min(lasts) <= max(firsts):
        return {}
    start, end = max(firsts), min(lasts)
    count = sum(1 for r in results for t in r["stamps"] if start < t <= end)
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:]) if start <= a and b <= end]
    return {"steady_tok_s": count / (end - start), "steady_itl_p50": pct(gaps, 0.5) if gaps else 0.0}


def request_lines(log: str) -> list[dict]:
    """Our request log's generation lines: where each request's TTFT went (arrive / queue /
    prefill ms), with its prompt and cached tokens."""
    keys = ("prompt_tokens", "cached_tokens", "arrive_ms", "queue_ms", "prefill_ms", "ttft_ms")
    out = []
    for line in log.splitlines():
        _, sep, payload = line.partition(" request {")
        if sep:
            try:
                fields = json.loads("{" + payload)
            except ValueError:
                continue
            if "prompt_tokens" in fields:
                out.append({k: fields.get(k) for k in keys})
    return out


async def agent(server: Server, turns: int, system_words: int, max_tokens: int, agents: int = 2) -> dict:
    """Conversations whose turns share their history: each turn's TTFT, then the last turn's
    prompt once more with its first system word changed, so that nothing before it is cached:
    that prompt cold, for `cold_speedup` (the same prompt, cold over warm)."""
    ttfts: dict[int, list[float]] = {t: [] for t in range(turns)}
    cold: list[float] = []
    async with httpx.AsyncClient(timeout=None) as client:
        await warm(client, server)
        for a in range(agents):
            history = [{"role": "system", "content": f"agent {a}. " + text_of(system_words, 99 + a)}]
            for t in range(turns):
                history.append({"role": "user", "content": f"agent {a} turn {t}: " + text_of(30, a * 31 + t)})
                r = await stream_chat(client, server, history, max_tokens)
                ttfts[t].append(r["ttft"])
                last = list(history)
                history.append({"role": "assistant", "content": r["text"]})
            if turns > 1:
                busted = [{"role": "system", "content": "cold" + last[0]["content"][len("agent") :]}, *last[1:]]
                cold.append((await stream_chat(client, server, busted, max_tokens))["ttft"])
    first = statistics.mean(ttfts[0])
    later = statistics.mean(x for t in range(1, turns) for x in ttfts[t])
    out = {
        "turn1_ttft": first,
        "turnN_ttft": later,
        "speedup": first / later if later else float("nan"),
        "by_turn": {t: statistics.mean(v) for t, v in ttfts.items()},
    }
    if cold:
        last_warm = statistics.mean(ttfts[turns - 1])
        out.update(
            lastturn_ttft=last_warm,
            lastturn_cold_ttft=statistics.mean(cold),
            cold_speedup=statistics.mean(cold) / last_warm,
        )
    return out


async def joiner(server: Server, streams: int, long_words: int) -> dict:
    """Streams decode; a long prompt arrives; the streams' worst gap until its first token."""
    async with httpx.AsyncClient(timeout=None) as client:
        await warm(client, server)
        stamps: list[list[float]] = [[] for _ in range(streams)]
        running = [
            asyncio.create_task(
                stream_chat(client, server, [{"role": "user", "content": text_of(20, i)}], 100_000, stamps=stamps[i])
            )
            for i in range(streams)
        ]
        await asyncio.sleep(1.0)  # let them all start decoding
        t_join = time.perf_counter()
        long_r = await stream_chat(client, server, [{"role": "user", "content": text_of(long_words, 5)}], 4)
        await asyncio.sleep(0.2)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    t_first = t_join + long_r["ttft"]
    gaps = [(a, b - a) for st in stamps for a, b in zip(st, st[1:])]
    before = [g for a, g in gaps if a + g < t_join]
    during = [g for a, g in gaps if a + g >= t_join and a <= t_first]
    return {
        "max_itl_during_join": max(during) if during else float("nan"),
        "long_ttft": long_r["ttft"],
        "itl_p50_before": pct(before, 0.5),
        "running_streams": streams,
        "running_tokens": [len(st) for st in stamps],
    }


async def stats(client: httpx.AsyncClient, server: Server) -> dict:
    return (await client.get(f"{server.url}/stats")).json()["batch"]


async def abort(server: Server, max_tokens: int, long_words: int) -> dict:
    """Disconnect mid-decode and mid-prefill; time until /stats counts the row aborted."""
    out = {}
    async with httpx.AsyncClient(timeout=None) as client:
        await warm(client, server)
        for phase, words, after in (("decode", 20, 4), ("prefill", long_words, 0)):
            before = await stats(client, server)
            body = {
                "model": server.model_name,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "messages": [{"role": "user", "content": f"abort {phase} " + text_of(words, 3)}],
            }
            async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                if after:
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            n += 1
                            if n >= after:
                                break
                else:
                    await asyncio.sleep(0.05)  # the request is in: admitted, prefilling
                t0 = time.perf_counter()
            # the stream is closed here: the client has disconnected
            while True:
                now = await stats(client, server)
                if now["aborted_rows"] > before["aborted_rows"]:
                    break
                if time.perf_counter() - t0 > 30:
                    now = None
                    break
                await asyncio.sleep(0.002)
            dt = time.perf_counter() - t0
            out[phase] = {
                "seconds": dt if now else float("nan"),
                "steps": (now["steps"] - before["steps"]) if now else None,
                "prefill_chunks": (now["prefill_chunks"] - before["prefill_chunks"]) if now else None,
            }
            # steps/chunks include those before the disconnect; report both raw counters
    return out


def exit_under_load(server: Server, streams: int, max_tokens: int) -> float:
    async def go() -> float:
        async with httpx.AsyncClient(timeout=None) as client:
            tasks = [
                asyncio.create_task(
                    stream_chat(client, server, [{"role": "user", "content": text_of(20, i)}], max_tokens)
                )
                for i in range(streams)
            ]
            await asyncio.sleep(0.3)  # every stream admitted and decoding
            loop = asyncio.get_running_loop()
            dt = await loop.run_in_executor(None, server.stop)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return dt

    return asyncio.run(go())


def restart(kind: str, model: Path, args) -> dict:
    """Warm restart: TTFT of one long prompt on a fresh server (cold), then again after a
    restart. Ours keeps its prompt cache on disk (--ssd-cache), mlx_lm.server has nothing to
    keep, so its 'restart' TTFT is a cold one again."""
    launch = "mlx_lm+blas" if kind == "mlx_lm" and args.mlx_lm_blas else kind
    prompt = [{"role": "user", "content": "restart " + text_of(args.restart_words, 7)}]

    async def one(server: Server) -> tuple[float, int, int]:
        async with httpx.AsyncClient(timeout=None) as client:
            r = await stream_chat(client, server, prompt, 4)
        usage = r["usage"] or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return r["ttft"], usage.get("prompt_tokens", 0), cached

    with tempfile.TemporaryDirectory() as ssd:
        extra = (["--ssd-cache", ssd] if kind == "ours" else []) + (
            args.ours_args if kind == "ours" else args.mlx_lm_args
        ).split()
        out = {}
        for phase in ("cold", "warm"):
            with Server(launch, model, free_port(), extra) as server:
                out[f"{phase}_ttft"], out["prompt_tokens"], out[f"{phase}_cached_tokens"] = asyncio.run(one(server))
                if kind == "ours":  # where the warm TTFT went: the restore, and the MLX thread per job
                    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
                    out[f"{phase}_stats"] = {"ssd_cache": stats.get("ssd_cache"), "worker": stats.get("worker")}
                out[f"{phase}_exit_s"] = server.stop()
    out["speedup"] = out["cold_ttft"] / out["warm_ttft"] if out["warm_ttft"] else float("nan")
    return out


def run_suite(kind: str, model: Path, args) -> dict:
    width = max(args.concurrency)
    default = [f"--batch={width}"] if kind == "ours" else [f"--decode-concurrency={width}"]
    if args.no_flags or (args.ours_args and kind == "ours" and "--batch" in args.ours_args):
        default = []
    extra = default + (args.ours_args if kind == "ours" else args.mlx_lm_args).split()
    out: dict = {"server": kind, "args": extra}
    with Server(kind, model, free_port(), extra, args.ours_switch_interval, args.profile_out) as server:
        out["start_s"] = server.start_s
        try:
            for c in args.concurrency:
                try:
                    runs = [
                        asyncio.run(concurrent(server, c, args.max_tokens, args.prompt_words, seed=100 * r + c))
                        for r in range(args.repeats)
                    ]
                except Exception as e:  # noqa: BLE001
                    out[f"c{c}_error"] = f"{type(e).__name__}: {e}"
                    print(f"  {kind} c={c}: {out[f'c{c}_error']}", file=sys.stderr, flush=True)
                    continue
                best = max(runs, key=lambda x: x["agg_tok_s"])
                best["agg_tok_s_all"] = [x["agg_tok_s"] for x in runs]
                if kind == "ours":  # where the MLX thread's time went, cumulative (/stats "worker")
                    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
                    best["worker"] = stats.get("worker")
                    best["batch"] = stats.get("batch")  # scheduler counters, recent_opens
                out[f"c{c}"] = best
                if not best.get("tokens"):  # streams that end with no tokens: say why (the first error)
                    log = server.tail(10**7)
                    first = log.find("Traceback")
                    print(log[first : first + 4000] if first >= 0 else log[-4000:], file=sys.stderr, flush=True)
                print(
                    f"  {kind} c={c}: " + json.dumps({k: v for k, v in best.items() if k not in ("ttfts", "itls")}),
                    file=sys.stderr,
                    flush=True,
                )
            extras = []
            if args.agent_turns:
                extras.append(("agent", lambda: agent(server, args.agent_turns, args.system_words, 16)))
            if args.joiner_words:
                extras.append(("joiner", lambda: joiner(server, 4, args.joiner_words)))
            if args.abort and kind == "ours":
                extras.append(("abort", lambda: abort(server, 4 * args.max_tokens, args.joiner_words or 2000)))
            for name, make in extras:
                try:
                    out[name] = asyncio.run(make())
                    if kind == "ours" and name == "agent":  # the server's own TTFT breakdown per turn
                        out[name]["server_lines"] = request_lines(server.tail(10**7))[-2 * args.agent_turns :]
                except Exception as e:  # noqa: BLE001 - one failed workload must not lose the rest
                    out[f"{name}_error"] = f"{type(e).__name__}: {e}"
                print(f"  {kind} {name}: {out.get(name, out.get(name + '_error'))}", file=sys.stderr, flush=True)
            if args.exit_streams:
                out["exit_s"] = exit_under_load(server, args.exit_streams, 4 * args.max_tokens)
            else:
                out["exit_s"] = server.stop()
            print(f"  {kind} exit: {out['exit_s']:.2f}s", file=sys.stderr, flush=True)
        except Exception:
            print(server.tail(), file=sys.stderr)
            raise
    return out


def ratio_table(ours: dict, ref: dict, args) -> str:
    rows = ["| workload | metric | ours | mlx_lm.server | ours / mlx_lm |", "|---|---|---|---|---|"]

    def row(work: str, metric: str, a: float, b: float, lower_is_better: bool = False) -> None:
        r = (b / a if lower_is_better else a / b) if a and b else float("nan")
        rows.append(f"| {work} | {metric} | {a:.4g} | {b:.4g} | {r:.2f}x{' (speed-up)' if lower_is_better else ''} |")

    for c in args.concurrency:
        if f"c{c}" not in ours or f"c{c}" not in ref:
            rows.append(f"| c={c} | (failed: {ours.get(f'c{c}_error') or ref.get(f'c{c}_error')}) | | | |")
            continue
        a, b = ours[f"c{c}"], ref[f"c{c}"]
        row(f"c={c}", "aggregate tok/s", a["agg_tok_s"], b["agg_tok_s"])
        row(f"c={c}", "per-stream decode tok/s", a["per_stream_tok_s"], b["per_stream_tok_s"])
        if "steady_tok_s" in a and "steady_tok_s" in b:
            row(f"c={c}", "all-streams decode tok/s", a["steady_tok_s"], b["steady_tok_s"])
        row(f"c={c}", "TTFT p50 s", a["ttft_p50"], b["ttft_p50"], lower_is_better=True)
        row(f"c={c}", "ITL p50 s", a["itl_p50"], b["itl_p50"], lower_is_better=True)
        row(f"c={c}", "ITL p99 s", a["itl_p99"], b["itl_p99"], lower_is_better=True)
    if "agent" in ours and "agent" in ref:
        row("agent", "turn-1 TTFT s", ours["agent"]["turn1_ttft"], ref["agent"]["turn1_ttft"], lower_is_better=True)
        row("agent", "turn-N TTFT s", ours["agent"]["turnN_ttft"], ref["agent"]["turnN_ttft"], lower_is_better=True)
        rows.append(
            f"| agent | turn-1 / turn-N TTFT | {ours['agent']['speedup']:.2f}x | {ref['agent']['speedup']:.2f}x | |"
        )
        if "cold_speedup" in ours["agent"] and "cold_speedup" in ref["agent"]:
            row(
                "agent",
                "last turn's prompt cold TTFT s",
                ours["agent"]["lastturn_cold_ttft"],
                ref["agent"]["lastturn_cold_ttft"],
                lower_is_better=True,
            )
            rows.append(
                f"| agent | last turn: cold / warm TTFT (same prompt) | {ours['agent']['cold_speedup']:.2f}x | "
                f"{ref['agent']['cold_speedup']:.2f}x | |"
            )
    if "joiner" in ours and "joiner" in ref:
        row(
            "long joiner",
            "max ITL of running streams s",
            ours["joiner"]["max_itl_during_join"],
            ref["joiner"]["max_itl_during_join"],
            lower_is_better=True,
        )
    if "abort" in ours:
        for phase, v in ours["abort"].items():
            rows.append(f"| abort ({phase}) | disconnect → row gone s (ours only) | {v['seconds']:.4g} | | |")
    label = f"exit s, {args.exit_streams} streams in flight" if args.exit_streams else "exit s, idle"
    row("SIGINT", label, ours["exit_s"], ref["exit_s"], lower_is_better=True)
    return "\n".join(rows)


def plots(results: dict, args, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in ("ours", "mlx_lm") if k in results]
    tag = f"{Path(results['model']).name}-{results['dtype']}{'-' + results['quant'] if results['quant'] else ''}"
    files = []
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k in kinds:
        cs = [c for c in args.concurrency if f"c{c}" in results[k]]
        ax.plot(cs, [results[k][f"c{c}"]["agg_tok_s"] for c in cs], marker="o", label=k)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_title(tag)
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"throughput-{tag}.png"
    fig.savefig(path, dpi=110)
    files.append(str(path))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    c = max(args.concurrency)
    for k in kinds:
        r = results[k].get(f"c{c}")
        if r is None:
            continue
        axes[0].hist([1000 * x for x in r["ttfts"]], bins=20, alpha=0.5, label=k)
        axes[1].hist([1000 * x for x in r["itls"]], bins=40, alpha=0.5, label=k, log=True)
    axes[0].set_xlabel(f"TTFT ms (c={c})")
    axes[1].set_xlabel(f"ITL ms (c={c})")
    for a in axes:
        a.legend()
    fig.suptitle(tag)
    fig.tight_layout()
    path = out_dir / f"latency-{tag}.png"
    fig.savefig(path, dpi=110)
    files.append(str(path))
    return files


def versions() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "processor": platform.processor()}
    for name in ("mlx", "mlx_lm", "trio", "hypercorn"):
        try:
            from importlib.metadata import version

            info[name] = version(name.replace("_", "-"))
        except Exception:  # noqa: BLE001
            info[name] = None
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
        info["cores"] = os.cpu_count()
    except Exception:  # noqa: BLE001
        pass
    try:
        info["gpu"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        info["gpu"] = None
    info["blas"] = blas_line()
    return info


def blas_line() -> str:
    """The BLAS our server (and mlx_lm+blas) binds MLX's CPU backend to, as the server logs it:
    asked in a fresh interpreter, because the preload must come before mlx is imported."""
    probe = "from model.load.blas import preload_optimized_blas; print(preload_optimized_blas().log_line())"
    try:
        return subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
        ).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--synth", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the synth shape's layer count")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=1, help="runs per concurrency; the best is kept")
    p.add_argument("--agent-turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--joiner-words", type=int, default=3000)
    p.add_argument("--abort", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--restart-words",
        type=int,
        default=0,
        help="warm-restart workload: a prompt of this many words, cold then after a restart (0: off)",
    )
    p.add_argument("--exit-streams", type=int, default=8, help="streams in flight at SIGINT (0: exit idle)")
    p.add_argument("--ours-args", default="")
    p.add_argument("--mlx-lm-args", default="")
    p.add_argument(
        "--no-flags",
        action="store_true",
        help="start both servers with their defaults: no --batch / --decode-concurrency sized to the workload",
    )
    p.add_argument("--only", choices=["ours", "mlx_lm"], default=None)
    p.add_argument(
        "--profile-out",
        type=Path,
        default=None,
        help="run our server under benchmarks/profile_serve.py; its per-thread profile lands here",
    )
    p.add_argument(
        "--ours-switch-interval",
        type=float,
        default=None,
        help="experiment: start our server with sys.setswitchinterval(S) (GIL hand-off)",
    )
    p.add_argument(
        "--mlx-lm-blas",
        action="store_true",
        help="start mlx_lm.server with the optimized BLAS our server preloads (Linux CPU)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--server-logs",
        type=Path,
        default=None,
        help="keep each server's output in this folder (<kind>-<port>.log; default: a temporary file)",
    )
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    p.add_argument("--replot", type=Path, default=None, help="only redraw --plots from a saved --out JSON")
    args = p.parse_args()
    Server.log_dir = args.server_logs
    if args.replot:
        saved = json.loads(args.replot.read_text())
        args.concurrency = [c for c in args.concurrency if f"c{c}" in saved.get("ours", {})]
        print(plots(saved, args, args.plots or args.replot.parent))
        return

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        shape = dict(SHAPES[args.synth or "cpu-small"])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        model = fast_model_dir(Path(tmp.name) / "m", dtype=args.dtype, quant=args.quant, **shape)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions(),
        "model": str(args.synth or model),
        "layers": args.layers,
        "dtype": args.dtype,
        "quant": args.quant,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "argv": sys.argv[1:],
    }
    if args.mlx_lm_blas and "reference" in results["versions"]["blas"]:
        # Both servers would run MLX's bundled reference BLAS: a fair comparison still, but not
        # the one the flag names, and fp32 prefill ~10-30x slower than with OpenBLAS.
        print(f"warning: --mlx-lm-blas but {results['versions']['blas']}", file=sys.stderr, flush=True)
    kinds = [args.only] if args.only else ["ours", "mlx_lm"]
    for kind in kinds:
        print(f"running {kind} ...", file=sys.stderr, flush=True)
        launch = "mlx_lm+blas" if kind == "mlx_lm" and args.mlx_lm_blas else kind
        results[kind] = run_suite(launch, model, args)
    results["mlx_lm_blas"] = args.mlx_lm_blas
    if args.restart_words:
        results["restart"] = {}
        for kind in kinds:
            try:
                results["restart"][kind] = restart(kind, model, args)
            except Exception as e:  # noqa: BLE001
                results["restart"][kind] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {kind} restart: {results['restart'][kind]}", file=sys.stderr, flush=True)
    if len(kinds) == 2:
        results["table"] = ratio_table(results["ours"], results["mlx_lm"], args)
        rs = results.get("restart", {})
        if "warm_ttft" in rs.get("ours", {}) and "warm_ttft" in rs.get("mlx_lm", {}):
            a, b = rs["ours"], rs["mlx_lm"]
            results["table"] += (
                f"\n| restart ({a['prompt_tokens']} tok) | TTFT after restart s (ours: SSD tier) | "
                f"{a['warm_ttft']:.4g} | {b['warm_ttft']:.4g} | {b['warm_ttft'] / a['warm_ttft']:.2f}x (speed-up) |"
                f"\n| restart | ours warm vs ours cold | {a['warm_ttft']:.4g} | {a['cold_ttft']:.4g} (ours cold) | "
                f"{a['speedup']:.2f}x (speed-up) |"
            )
        print(results["table"])
    if args.plots:
        try:
            results["plots"] = plots(results, args, args.plots)
        except Exception as e:  # noqa: BLE001
            results["plots"] = f"failed: {e}"
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in results.items() if k not in ("ours", "mlx_lm")}, indent=2, default=str))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
