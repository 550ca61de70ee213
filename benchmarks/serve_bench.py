"""Side-by-side serving benchmark: our server vs mlx_lm.server on the same model directory.

Starts each server as a subprocess (one at a time, so they never share the machine), drives the
same OpenAI streaming workloads through HTTP, and prints a markdown table of ratios (ours /
mlx_lm) plus JSON. Workloads:
  c1      one stream: decode tok/s and TTFT
  cN      N concurrent streams (default 8 and 32): aggregate output tok/s, TTFT, ITL p50/p99
  agent   multi-turn conversations sharing a long system prompt: turn-1 vs turn-N TTFT
  joiner  a long-prompt request joins running streams: their max ITL (ours only meaningful)

Usage:
  python benchmarks/serve_bench.py --model DIR [--max-tokens 128] [--concurrency 1,8,32]
  python benchmarks/serve_bench.py --synth qwen3-0.6b --dtype bfloat16    # random weights, real shape
"""

from __future__ import annotations

import argparse
import asyncio
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

SHAPES = {
    # Real architectures, random weights (only shapes matter for speed).
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "llama3-8b": dict(family="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      tie_word_embeddings=False, rope_scaling="llama3", max_position_embeddings=131072),
    "cpu-small": dict(family="qwen3", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13) % len(WORDS)] for i in range(n_words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, kind: str, model: Path, port: int, extra: list[str]):
        self.kind, self.port = kind, port
        if kind == "ours":
            cmd = [sys.executable, "-m", "actors.serve", "--model", str(model), "--port", str(port), *extra]
        else:
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port), *extra]
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.kind} server exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.kind} server did not become healthy")

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


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
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
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or len(stamps)
    return {"ttft": (stamps[0] - t0) if stamps else end - t0, "stamps": stamps, "start": t0, "end": end,
            "tokens": tokens, "text": "".join(text), "usage": usage}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def concurrent(url: str, c: int, max_tokens: int, prompt_words: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        await stream_chat(client, url, [{"role": "user", "content": "warm up"}], 4)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            stream_chat(client, url, [{"role": "user", "content": text_of(prompt_words, i)}], max_tokens)
            for i in range(c)
        ])
        wall = time.perf_counter() - t0
    itls = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    total = sum(r["tokens"] for r in results)
    decode_rates = [(r["tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0])
                    for r in results if len(r["stamps"]) > 1 and r["stamps"][-1] > r["stamps"][0]]
    return {"concurrency": c, "agg_tok_s": total / wall, "ttft_p50": pct([r["ttft"] for r in results], 0.5),
            "ttft_p99": pct([r["ttft"] for r in results], 0.99), "itl_p50": pct(itls, 0.5),
            "itl_p99": pct(itls, 0.99), "per_stream_tok_s": statistics.mean(decode_rates) if decode_rates else 0.0}


async def agent(url: str, turns: int, system_words: int, max_tokens: int, agents: int = 2) -> dict:
    system = text_of(system_words, 99)
    ttfts: dict[int, list[float]] = {t: [] for t in range(turns)}
    async with httpx.AsyncClient(timeout=None) as client:
        for a in range(agents):
            history = [{"role": "system", "content": system}]
            for t in range(turns):
                history.append({"role": "user", "content": f"agent {a} turn {t}: " + text_of(30, a * 31 + t)})
                r = await stream_chat(client, url, history, max_tokens)
                ttfts[t].append(r["ttft"])
                history.append({"role": "assistant", "content": r["text"]})
    first = statistics.mean(ttfts[0])
    later = statistics.mean(x for t in range(1, turns) for x in ttfts[t])
    return {"turn1_ttft": first, "turnN_ttft": later, "speedup": first / later if later else float("nan")}


async def joiner(url: str, streams: int, max_tokens: int, long_words: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        await stream_chat(client, url, [{"role": "user", "content": "warm up"}], 4)
        running = [asyncio.create_task(stream_chat(client, url, [{"role": "user", "content": text_of(20, i)}],
                                                   max_tokens)) for i in range(streams)]
        await asyncio.sleep(1.0)
        t_join = time.perf_counter()
        long = asyncio.create_task(stream_chat(client, url, [{"role": "user", "content": text_of(long_words, 5)}], 8))
        results = await asyncio.gather(*running)
        long_r = await long
    during = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:]) if b >= t_join]
    return {"max_itl_during_join": max(during) if during else float("nan"), "long_ttft": long_r["ttft"],
            "itl_p50": pct([b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])], 0.5)}


def run_suite(kind: str, model: Path, args) -> dict:
    extra = args.ours_args if kind == "ours" else args.mlx_lm_args
    out: dict = {"server": kind}
    with Server(kind, model, free_port(), extra.split()) as server:
        for c in args.concurrency:
            out[f"c{c}"] = asyncio.run(concurrent(server.url, c, args.max_tokens, args.prompt_words))
            print(f"  {kind} c={c}: {out[f'c{c}']}", file=sys.stderr)
        if args.agent_turns:
            out["agent"] = asyncio.run(agent(server.url, args.agent_turns, args.system_words, 16))
            print(f"  {kind} agent: {out['agent']}", file=sys.stderr)
        if args.joiner_words:
            out["joiner"] = asyncio.run(joiner(server.url, 4, args.max_tokens, args.joiner_words))
            print(f"  {kind} joiner: {out['joiner']}", file=sys.stderr)
        out["exit_s"] = server.stop()
    return out


def ratio_table(ours: dict, ref: dict, args) -> str:
    rows = ["| workload | metric | ours | mlx_lm.server | ours / mlx_lm |", "|---|---|---|---|---|"]

    def row(work: str, metric: str, a: float, b: float, lower_is_better: bool = False) -> None:
        r = (b / a if lower_is_better else a / b) if a and b else float("nan")
        rows.append(f"| {work} | {metric} | {a:.4g} | {b:.4g} | {r:.2f}x{' (speed-up)' if lower_is_better else ''} |")

    for c in args.concurrency:
        a, b = ours[f"c{c}"], ref[f"c{c}"]
        row(f"c={c}", "aggregate tok/s", a["agg_tok_s"], b["agg_tok_s"])
        row(f"c={c}", "per-stream decode tok/s", a["per_stream_tok_s"], b["per_stream_tok_s"])
        row(f"c={c}", "TTFT p50 s", a["ttft_p50"], b["ttft_p50"], lower_is_better=True)
        row(f"c={c}", "ITL p99 s", a["itl_p99"], b["itl_p99"], lower_is_better=True)
    if "agent" in ours:
        row("agent", "turn-N TTFT s", ours["agent"]["turnN_ttft"], ref["agent"]["turnN_ttft"], lower_is_better=True)
        rows.append(f"| agent | turn-1 / turn-N TTFT (ours) | {ours['agent']['speedup']:.2f}x | "
                    f"{ref['agent']['speedup']:.2f}x | |")
    if "joiner" in ours:
        row("long joiner", "max ITL of running streams s", ours["joiner"]["max_itl_during_join"],
            ref["joiner"]["max_itl_during_join"], lower_is_better=True)
    row("Ctrl-C", "exit seconds", ours["exit_s"], ref["exit_s"], lower_is_better=True)
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--synth", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--agent-turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--joiner-words", type=int, default=3000)
    p.add_argument("--ours-args", default="")
    p.add_argument("--mlx-lm-args", default="")
    p.add_argument("--only", choices=["ours", "mlx_lm"], default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    tmp = None
    model = args.model
    if model is None:
        from model.synth import write_model_dir

        tmp = tempfile.TemporaryDirectory()
        shape = dict(SHAPES[args.synth or "cpu-small"])
        model = write_model_dir(Path(tmp.name) / "m", dtype=args.dtype, quant=args.quant, **shape)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "model": str(args.synth or model),
               "dtype": args.dtype, "quant": args.quant, "max_tokens": args.max_tokens}
    kinds = [args.only] if args.only else ["ours", "mlx_lm"]
    for kind in kinds:
        print(f"running {kind} ...", file=sys.stderr)
        results[kind] = run_suite(kind, model, args)
    if len(kinds) == 2:
        results["table"] = ratio_table(results["ours"], results["mlx_lm"], args)
        print(results["table"])
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
