"""The model pool (issue 47): switching between two models, and c streams split across two resident
models vs all on one.

    python benchmarks/pool_switch.py --model /tmp/models/l8-q4 --out pool.json
    python benchmarks/pool_switch.py --synth cpu-small --dtype float32 --prompt-tokens 2048 --max-tokens 64

Two model directories A and B under a temporary --models-dir, both built of symlinks to the files
of --model (or of a --synth model): no second copy of the weights. B's config.json is a copy with
one extra key, so B's weights fingerprint, hence its SSD tier directory, is its own (one
fingerprint for both would make the second SSD tier refuse to open). The pool names models by
directory name and resolves each directory, so B must be a directory of its own, not a symlink to
A's. The two share their files, so every load after the first reads them from the page cache.

Switching (`--model-pool 1 --ssd-cache TMP`, B the default: loaded at start, so A's first request
loads it):
  first        A's first request, a --prompt-tokens prompt P0: B leaves, A loads, P0 prefills cold
  hot          P0 again on A, resident: served from the RAM prompt cache
  cold         fresh prompts of the same length on A, resident: cold prefill, no load
  to_b         a short prompt on B: A drains its prompt cache to the SSD tier and leaves, B loads
  warm_return  P0 on A again: B leaves, A loads, P0 restored from the SSD tier (cached_tokens)
  cold_return  a fresh prompt on A after B: a switch whose prompt has no cache (load + cold prefill)
cold_load_s = first TTFT - best cold TTFT; the server's own load span (its log: "loading model A"
to "model A loaded") and drain time are reported with each switch.

Throughput (`--model-pool 2`, both resident, a second server): --concurrency greedy streams of
--c-max-tokens each, all on A, then half on A and half on B (fresh prompts each run); aggregate
completion tok/s = completion tokens / wall. Best of --repeats.

TTFT is the client's: from sending the streamed /v1/completions request (token-id prompts, so
lengths are exact whatever the tokenizer) to its first token. Prints a table to stderr and the
JSON to --out (and stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_bench import Server, free_port, versions  # noqa: E402
from benchmarks.synth_fast import SHAPES, fast_model_dir  # noqa: E402

A, B = "A", "B"
_TS = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ "
_LOADING = re.compile(_TS + r"actors\.root: loading model (\S+) \.\.\.", re.M)
_LOADED = re.compile(_TS + r"actors\.pool: model (\S+) loaded in", re.M)
_LEAVES = re.compile(_TS + r"actors\.pool: model (\S+) leaves the pool", re.M)
_DRAINED = re.compile(
    _TS + r"actors\.ssd\.drain: drained the prompt cache to the SSD tier: (\d+) entr\w+ written, (\d+) failed, "
    r"(\d+) on disk \((\d+) ms\)",
    re.M,
)
_REQUEST = re.compile(_TS + r"mlx_trio\.requests: request (\{.*\})$", re.M)


# -- the two model directories


def link_models(source: Path, root: Path) -> Path:
    """`root` holding A and B: directories of symlinks to `source`'s files; B's config.json a copy
    with one key more (its own fingerprint, so its own SSD tier directory)."""
    source = source.resolve()
    for name in (A, B):
        target = root / name
        target.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and not (name == B and f.name == "config.json"):
                (target / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config["pool_switch_copy"] = B  # (no loader reads it; the fingerprint hashes the whole config)
    (root / B / "config.json").write_text(json.dumps(config, indent=2))
    return root


def token_pool(model_dir: Path) -> list[int]:
    """Ordinary (not added, not special) token ids of the model's tokenizer.json."""
    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids -= {t["id"] for t in tok.get("added_tokens", [])}
        return sorted(i for i in ids if i >= 3)
    except (OSError, KeyError, TypeError, ValueError):
        return list(range(100, 1000))


class Prompts:
    """Distinct random token-id prompts: no two share a prefix the prompt cache could reuse."""

    def __init__(self, pool: list[int], seed: int = 0) -> None:
        self.pool = pool
        self.rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(n)]


# -- requests


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One greedy streamed /v1/completions: TTFT (to the first token), its token ids and usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    t0 = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                named = (choice.get("logprobs") or {}).get("tokens") or []
                if named and first is None:
                    first = time.perf_counter()
                tokens += [int(t.removeprefix("token_id:")) for t in named]
    end = time.perf_counter()
    return {
        "ttft_s": (first if first is not None else end) - t0,
        "total_s": end - t0,
        "start": t0,
        "end": end,
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", len(tokens)),
    }


class ServerLog:
    """The server's log since the last look: what each request did inside the server."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.seen = 0

    def new(self) -> str:
        text = self.server.tail(10**10)
        part, self.seen = text[self.seen :], len(text)
        return part

    async def after_request(self) -> str:
        """The new log, once the request's own log line is in it (written as its reply ends)."""
        part = ""
        for _ in range(100):
            part += self.new()
            if '"route": "/v1/completions"' in part:
                break
            await asyncio.sleep(0.02)
        return part


def _ts(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1000


def log_events(part: str) -> dict[str, Any]:
    """What one request's stretch of the log says: the server's load span per model, the drains,
    the request line's own timings (arrive_ms holds the wait for the model)."""
    out: dict[str, Any] = {}
    loading: dict[str, float] = {}
    for m in _LOADING.finditer(part):
        loading.setdefault(m[2], _ts(m[1]))
    for m in _LOADED.finditer(part):
        if m[2] in loading:
            out.setdefault("load_s", {})[m[2]] = round(_ts(m[1]) - loading[m[2]], 3)
    left = [m[2] for m in _LEAVES.finditer(part)]
    if left:
        out["left"] = left
    drains = [
        {"written": int(m[2]), "failed": int(m[3]), "on_disk": int(m[4]), "ms": int(m[5])}
        for m in _DRAINED.finditer(part)
    ]
    if drains:
        out["drains"] = drains
    for m in _REQUEST.finditer(part):
        line = json.loads(m[2])
        if line.get("route") == "/v1/completions":
            keys = ("model", "prompt_tokens", "cached_tokens", "arrive_ms", "queue_ms", "prefill_ms", "ttft_ms")
            out["request"] = {k: line.get(k) for k in keys}
    return out


async def shot(server: Server, log: ServerLog, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone, with what the server's log says about it."""
    log.new()
    async with httpx.AsyncClient(timeout=None) as client:
        r = await stream_completion(client, server.url, model, prompt, max_tokens)
    r.update(log_events(await log.after_request()))
    return r


def same_lead(a: list, b: list) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k not in ("start", "end")}


@contextlib.contextmanager
def running(model: Path, extra: list[str], pid_file: Path | None) -> Iterator[Server]:
    """Our server on `model` with `extra` flags; stopped (SIGINT) on the way out, killed if the
    start itself is interrupted; its pid appended to `pid_file` for the wrapper's trap."""
    server = Server("ours", model, free_port(), extra)
    try:
        server.__enter__()
    except BaseException:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        raise
    if pid_file is not None:
        with pid_file.open("a") as f:
            f.write(f"{server.proc.pid}\n" if server.proc else "")
    try:
        yield server
    except BaseException:
        print(server.tail(4000), file=sys.stderr)
        raise
    finally:
        server.__exit__(None, None, None)


async def statuses(server: Server) -> dict[str, str]:
    async with httpx.AsyncClient(timeout=30) as client:
        cards = (await client.get(f"{server.url}/v1/models")).json()["data"]
    return {c["id"]: c.get("status", "?") for c in cards if c["id"] in (A, B)}


# -- the two parts


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of least TTFT, with every run's TTFT."""
    b = brief(min(runs, key=lambda r: r["ttft_s"]))
    b["ttft_s_all"] = [round(r["ttft_s"], 4) for r in runs]
    return b


def server_load(r: dict[str, Any], model: str) -> float | None:
    value = (r.get("load_s") or {}).get(model)
    return None if value is None else float(value)


async def switching(server: Server, args: argparse.Namespace, prompts: Prompts, out: dict[str, Any]) -> None:
    """Fills `out` as it goes (an interrupted run keeps what it measured): raw runs in `runs`,
    the summary once all are in."""
    log = ServerLog(server)
    n, m = args.prompt_tokens, args.max_tokens
    p0 = prompts.make(n)
    out.update(start_s=server.start_s, statuses_at_start=await statuses(server))
    runs: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("first", "hot", "cold", "to_b", "warm_return", "cold_return")
    }
    out["runs"] = runs

    async def one(kind: str, model: str, prompt: list[int]) -> dict[str, Any]:
        r = await shot(server, log, model, prompt, m)
        runs[kind].append(r)
        return r

    first = await one("first", A, p0)
    say(f"pool: first request on A (load + cold {n}): {first['ttft_s']:.3f} s; server load {first.get('load_s')}")
    for _ in range(args.repeats):
        await one("hot", A, p0)
    for _ in range(args.repeats):
        await one("cold", A, prompts.make(n))
    hot_s, cold_s = ([round(r["ttft_s"], 3) for r in runs[k]] for k in ("hot", "cold"))
    say(f"pool: hot {hot_s} s, cold {cold_s} s")
    for _ in range(args.repeats):
        to_b = await one("to_b", B, prompts.make(args.switch_prompt_tokens))
        warm = await one("warm_return", A, p0)
        to_b2 = await one("to_b", B, prompts.make(args.switch_prompt_tokens))
        cold_return = await one("cold_return", A, prompts.make(n))
        say(
            f"pool: to B {to_b['ttft_s']:.3f} s; warm return {warm['ttft_s']:.3f} s "
            f"(cached {warm['cached_tokens']}/{warm['prompt_tokens']}); "
            f"to B {to_b2['ttft_s']:.3f} s; cold return {cold_return['ttft_s']:.3f} s"
        )
    warm_runs = runs["warm_return"]
    cold_best = min(r["ttft_s"] for r in runs["cold"])
    out.update(
        prompt_tokens=first["prompt_tokens"],
        first=brief(first),
        cold_load_s=first["ttft_s"] - cold_best,
        server_load_s=server_load(first, A),
        **{kind: best(runs[kind]) for kind in ("cold", "hot", "to_b", "warm_return", "cold_return")},
        warm_return_cached_share=min(r["cached_tokens"] / r["prompt_tokens"] for r in warm_runs),
        warm_return_minus_load_s=[
            round(r["ttft_s"] - load, 4) for r in warm_runs if (load := server_load(r, A)) is not None
        ],
        cold_return_minus_load_s=[
            round(r["ttft_s"] - load, 4) for r in runs["cold_return"] if (load := server_load(r, A)) is not None
        ],
        # greedy tokens: P0 restored (RAM or SSD) must give what P0 prefilled gave
        hot_equals_cold=all(r["tokens"] == first["tokens"] for r in runs["hot"]),
        warm_equals_cold=all(r["tokens"] == first["tokens"] for r in warm_runs),
        # how far they agree (bf16 on a GPU: a 1-token prefill and a chunk's last row round apart)
        same_leading_tokens=[same_lead(r["tokens"], first["tokens"]) for r in runs["hot"] + warm_runs],
        statuses_at_end=await statuses(server),
    )
    out["runs"] = {kind: [brief(r) for r in rs] for kind, rs in runs.items()}
    async with httpx.AsyncClient(timeout=30) as client:
        pool = (await client.get(f"{server.url}/stats")).json()["models"]
    out["pool_stats"] = {k: v for k, v in pool.items() if k != "resident"}


async def streams(server: Server, models: list[str], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *[stream_completion(client, server.url, m, p, max_tokens) for m, p in zip(models, prompts)]
        )
        wall = time.perf_counter() - t0
    total = sum(r["completion_tokens"] for r in runs)
    per_model: dict[str, int] = {}
    for m, r in zip(models, runs):
        per_model[m] = per_model.get(m, 0) + r["completion_tokens"]
    ttfts = sorted(r["ttft_s"] for r in runs)
    decode = [
        (r["completion_tokens"] - 1) / (r["end"] - r["start"] - r["ttft_s"])
        for r in runs
        if r["completion_tokens"] > 1 and r["end"] - r["start"] > r["ttft_s"]
    ]
    return {
        "wall_s": wall,
        "tokens": total,
        "tokens_per_model": per_model,
        "agg_tok_s": total / wall,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_max_s": ttfts[-1],
        "per_stream_tok_s": sum(decode) / len(decode) if decode else 0.0,
    }


async def throughput(server: Server, args: argparse.Namespace, prompts: Prompts, out: dict[str, Any]) -> None:
    """Fills `out` as it goes: each kept round in `runs`, the best of each layout at the end."""
    log = ServerLog(server)
    c, m = args.concurrency, args.c_max_tokens
    out["start_s"] = server.start_s
    out["load_b"] = brief(await shot(server, log, B, prompts.make(args.switch_prompt_tokens), 4))  # B joins A
    await shot(server, log, A, prompts.make(args.switch_prompt_tokens), 4)
    layouts = {"one": [A] * c, "split": [A if i % 2 == 0 else B for i in range(c)]}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in layouts}
    out["runs"] = runs
    for r in range(args.repeats + (1 if args.warm_run else 0)):
        for name, models in layouts.items():
            result = await streams(server, models, [prompts.make(args.c_prompt_tokens) for _ in models], m)
            say(f"pool: c={c} {name}: {result['agg_tok_s']:.1f} tok/s ({result['tokens_per_model']})")
            if r or not args.warm_run:
                runs[name].append(result)
    for name, results in runs.items():
        b = dict(max(results, key=lambda x: x["agg_tok_s"]))
        b["agg_tok_s_all"] = [round(x["agg_tok_s"], 2) for x in results]
        out[name] = b
    out["split_over_one"] = out["split"]["agg_tok_s"] / out["one"]["agg_tok_s"]
    out["statuses_at_end"] = await statuses(server)
    async with httpx.AsyncClient(timeout=30) as client:
        pool = (await client.get(f"{server.url}/stats")).json()["models"]
    out["pool_stats"] = {k: v for k, v in pool.items() if k != "resident"}


def table(results: dict[str, Any]) -> str:
    """The summary as markdown; a part that did not finish shows the runs it has."""
    rows = ["| part | what | value |", "|---|---|---|"]
    s = results.get("switch") or {}
    if "warm_equals_cold" in s:
        n = s["prompt_tokens"]

        def ttft(label: str, r: dict[str, Any], note: str = "") -> None:
            rows.append(
                f"| switch | {label} | {r['ttft_s']:.3f} s (cached {r['cached_tokens']}/{r['prompt_tokens']}){note} |"
            )

        ttft(f"A's first request, {n} tok (load + cold prefill)", s["first"])
        rows.append(
            f"| switch | cold load (first - cold TTFT) | {s['cold_load_s']:.3f} s (server: {s['server_load_s']} s) |"
        )
        ttft(f"cold TTFT, {n} tok, A resident", s["cold"])
        ttft(f"hot TTFT, {n} tok, A resident (RAM)", s["hot"])
        ttft("switch A -> B (A drains, B loads; short prompt)", s["to_b"], f" drains {s['to_b'].get('drains')}")
        ttft(f"warm return B -> A, {n} tok (SSD)", s["warm_return"], f" load {s['warm_return'].get('load_s')}")
        ttft(f"cold return B -> A, {n} tok (no cache)", s["cold_return"], f" load {s['cold_return'].get('load_s')}")
        rows.append(
            f"| switch | warm / cold return TTFT | {s['warm_return']['ttft_s'] / s['cold_return']['ttft_s']:.2f}x |"
        )
        rows.append(f"| switch | warm return cached share (min) | {s['warm_return_cached_share']:.3f} |")
        rows.append(f"| switch | greedy equal: hot, warm return | {s['hot_equals_cold']}, {s['warm_equals_cold']} |")
    else:
        for kind, rs in (s.get("runs") or {}).items():
            if rs:
                got = ", ".join(f"{r['ttft_s']:.3f} s ({r['cached_tokens']}/{r['prompt_tokens']})" for r in rs)
                rows.append(f"| switch (unfinished) | {kind} TTFT (cached) | {got} |")
    t = results.get("throughput") or {}
    c = results["concurrency"]
    labels = {"one": f"c={c} all on A", "split": f"c={c}: {c - c // 2} on A + {c // 2} on B"}
    if "split_over_one" in t:
        for name, label in labels.items():
            r = t[name]
            rows.append(
                f"| throughput | {label} | {r['agg_tok_s']:.1f} tok/s aggregate, {r['per_stream_tok_s']:.1f} "
                f"tok/s per stream, TTFT p50 {r['ttft_p50_s']:.3f} s |"
            )
        rows.append(f"| throughput | split / one | {t['split_over_one']:.2f}x |")
    else:
        for name, rs in (t.get("runs") or {}).items():
            if rs:
                got = ", ".join(f"{r['agg_tok_s']:.1f}" for r in rs)
                rows.append(f"| throughput (unfinished) | {labels[name]} aggregate tok/s | {got} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="the model directory A and B are linked to")
    p.add_argument("--synth", choices=sorted(SHAPES), help="a random-weight model of this shape instead")
    p.add_argument("--layers", type=int, default=None, help="override the synth shape's layer count")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", default=None)
    p.add_argument("--prompt-tokens", type=int, default=4096, help="the switching part's long prompt")
    p.add_argument("--switch-prompt-tokens", type=int, default=32, help="the prompt that switches to B")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per switching-part request")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--c-prompt-tokens", type=int, default=512)
    p.add_argument("--c-max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="samples of each measurement; the best is kept")
    p.add_argument(
        "--warm-run", action=argparse.BooleanOptionalAction, default=True, help="one unkept throughput round first"
    )
    p.add_argument("--parts", default="switch,throughput", help="which parts, comma-separated")
    p.add_argument("--ours-args", default="", help="more flags for both servers")
    p.add_argument("--work-dir", type=Path, default=None, help="where A, B and the SSD tier go (default: a temp dir)")
    p.add_argument("--pid-file", type=Path, default=None, help="append each server's pid here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    parts = set(args.parts.split(","))

    tmp = tempfile.TemporaryDirectory(prefix="pool-switch-") if args.work_dir is None else None
    work = Path(tmp.name) if tmp is not None else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    source = args.model
    if source is None:
        shape: dict[str, Any] = dict(SHAPES[args.synth or "cpu-small"])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        need = 2 * (args.prompt_tokens + args.max_tokens)
        shape["max_position_embeddings"] = max(int(shape.get("max_position_embeddings", 4096)), need)
        source = fast_model_dir(work / "base", dtype=args.dtype, quant=args.quant, **shape)
    models = link_models(source, work / "models")
    prompts = Prompts(token_pool(source))
    extra = args.ours_args.split()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": versions(),
        "model": str(args.synth or source),
        "dtype": args.dtype if args.model is None else None,
        "quant": args.quant if args.model is None else None,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "c_prompt_tokens": args.c_prompt_tokens,
        "c_max_tokens": args.c_max_tokens,
        "repeats": args.repeats,
        "argv": sys.argv[1:],
        "note": "A and B share their weight files (symlinks): loads after the first read the page cache",
    }
    try:
        if "switch" in parts:
            ssd = work / "ssd"
            flags = ["--models-dir", str(models), "--model-pool", "1", "--ssd-cache", str(ssd), *extra]
            say(f"switching: --model-pool 1, --ssd-cache {ssd} ...")
            with running(models / B, flags, args.pid_file) as server:
                asyncio.run(switching(server, args, prompts, results.setdefault("switch", {})))
                results["switch"]["exit_s"] = server.stop()
        if "throughput" in parts:
            flags = ["--models-dir", str(models), "--model-pool", "2", *extra]
            say("throughput: --model-pool 2 ...")
            with running(models / A, flags, args.pid_file) as server:
                asyncio.run(throughput(server, args, prompts, results.setdefault("throughput", {})))
                results["throughput"]["exit_s"] = server.stop()
    finally:
        results["table"] = table(results)
        say(results["table"])
        text = json.dumps(results, indent=2, default=str)
        if args.out:
            args.out.write_text(text)
        print(text)
        if tmp is not None:
            shutil.rmtree(tmp.name, ignore_errors=True)


if __name__ == "__main__":
    main()
