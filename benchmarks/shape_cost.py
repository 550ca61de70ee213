"""Where a new prefill shape's first-time cost goes on CUDA, and whether padded prefill is exact.

MLX's CUDA attention builds a cuDNN graph per new (q, k, mask) shape. This measures, first call
against a repeat: (sdpa) the attention op alone — causal, causal with an offset, and with a
left-padding array mask at B=8; (gemm) a projection at new M; (prefill) a whole model prefill at
new lengths. Then (exact) whether the engine's bucketed prefill (right-padded, trimmed back) and
its group prefill give the same greedy tokens as exact-width solo prefill.

    python benchmarks/shape_cost.py --model DIR [--sections sdpa,gemm,prefill,exact,rowdiff,hit,longdecode] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from model.kv.cache import make_caches  # noqa: E402
from model.load.loader import load_model  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return round(1e3 * (time.perf_counter() - t), 3)


def first_and_again(fn, shapes) -> list[dict]:
    out = []
    for s in shapes:
        out.append({"shape": s, "first_ms": timed(lambda: fn(s))})
    for i, s in enumerate(shapes):
        out[i]["again_ms"] = timed(lambda: fn(s))
    return out


def sdpa_section(H=16, Hk=8, D=128) -> dict:
    dt = mx.bfloat16
    r = {}

    def causal(s):
        B, q, k = s
        Q = mx.random.normal((B, H, q, D)).astype(dt)
        K = mx.random.normal((B, Hk, k, D)).astype(dt)
        return mx.fast.scaled_dot_product_attention(Q, K, K, scale=D**-0.5, mask="causal")

    def arr_mask(s):
        B, q, k = s
        Q = mx.random.normal((B, H, q, D)).astype(dt)
        K = mx.random.normal((B, Hk, k, D)).astype(dt)
        pads = mx.arange(B) * 3
        rinds = mx.arange(k)
        m = (rinds[:, None] >= rinds[None]) & (mx.expand_dims(pads, (1, 2, 3)) <= rinds)
        return mx.fast.scaled_dot_product_attention(Q, K, K, scale=D**-0.5, mask=m)

    mx.eval(causal((1, 8, 8)))
    r["causal_b1"] = first_and_again(causal, [(1, n, n) for n in range(70, 80)])
    r["causal_b1_pow2"] = first_and_again(causal, [(1, n, n) for n in (64, 128, 256, 512)])
    r["causal_offset"] = first_and_again(causal, [(1, 64, 1000 + 37 * i) for i in range(6)])
    r["causal_b8"] = first_and_again(causal, [(8, n, n) for n in (96, 97, 128)])
    r["causal_b32"] = first_and_again(causal, [(32, n, n) for n in (96, 128)])
    r["mask_b8"] = first_and_again(arr_mask, [(8, n, n) for n in (96, 97, 128)])
    r["mask_b32"] = first_and_again(arr_mask, [(32, n, n) for n in (96, 128)])
    return r


def gemm_section() -> dict:
    W = mx.random.normal((3072, 1024)).astype(mx.bfloat16)

    def mm(m):
        return mx.random.normal((m, 1024)).astype(mx.bfloat16) @ W.T

    mx.eval(mm(8))
    return {"gemm": first_and_again(mm, list(range(70, 80)) + [640, 641])}


def prefill_section(model, vocab: int) -> dict:
    def run(n):
        caches = make_caches(len(model.layers))
        toks = mx.array([[(7 * n + 13 * i) % (vocab - 10) + 5 for i in range(n)]])
        model(toks, caches)
        return [c.state for c in caches]

    mx.eval(run(16))
    return {"prefill": first_and_again(run, list(range(70, 80)) + [256, 257, 512, 513])}


def exact_section(model, vocab: int, gen: int = 24) -> dict:
    """Engine-level: greedy tokens of exact-width solo prefill (the reference, as mlx-lm runs it)
    against bucketed solo prefill and against one group prefill of all rows (bucketed)."""
    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec
    from model.options import EngineOptions
    from tests.engine_helpers import decode_to_the_end, generate_tokens

    lengths = (37, 70, 77, 100, 129, 200, 64, 5)
    specs = [
        RowSpec(i, tuple((11 * n + 17 * j) % (vocab - 10) + 5 for j in range(n)), SamplingParams(), gen)
        for i, n in enumerate(lengths)
    ]
    bucket = EngineOptions(prefill_bucket=64)
    reference = generate_tokens(Engine(model, eos_token_ids=[], options=EngineOptions(prefill_bucket=0)), specs)
    bucketed = generate_tokens(Engine(model, eos_token_ids=[], options=bucket), specs)
    engine = Engine(model, eos_token_ids=[], options=bucket)
    for spec in specs:
        engine.open_row(spec)
    engine.prefill_group([s.row_id for s in specs])
    grouped = decode_to_the_end(
        engine, {s.row_id: [engine.join(s.row_id).token] for s in specs}, {s.row_id for s in specs}
    )
    return {
        "lengths": lengths,
        "bucketed_equal": [bucketed[s.row_id] == reference[s.row_id] for s in specs],
        "grouped_equal": [grouped[s.row_id] == reference[s.row_id] for s in specs],
        "grouped_first_mismatch": [_first_mismatch(grouped[s.row_id], reference[s.row_id]) for s in specs],
    }


def rowdiff_section(model, vocab: int) -> dict:
    """Per row of a padded multi-row forward: the first layer whose keys differ from the row's
    solo exact-width prefill, and the max difference there (None: bit-identical throughout)."""
    L = len(model.layers)
    out = {}

    def first_diff(solo, group, i, n):
        for layer, (a, b) in enumerate(zip(solo, group)):
            d = float(mx.max(mx.abs(a.keys[0, :, :n].astype(mx.float32) - b.keys[i, :, :n].astype(mx.float32))).item())
            if d > 0:
                return layer, d
        return None

    for name, ns, pad, dup in (
        ("repeat_dup", (36, 63, 4), "repeat", True),
        ("repeat_nodup", (36, 63, 4), "repeat", False),
        ("zero_pad", (36, 63, 4), "zero", False),
        ("pair", (36, 4), "repeat", False),
        ("same_len", (36, 36), "repeat", False),
        ("wide", (36, 100, 200), "repeat", False),
    ):
        prompts = [[(11 * n + 17 * j) % (vocab - 10) + 5 for j in range(n)] for n in ns]
        width = -(-max(ns) // 64) * 64
        rows = [p + ([p[-1]] if pad == "repeat" else [0]) * (width - len(p)) for p in prompts]
        if dup:
            rows += rows[:1]
        group = make_caches(L)
        model(mx.array(rows), group)
        res = []
        for i, p in enumerate(prompts):
            solo = make_caches(L)
            model(mx.array([p]), solo)
            res.append(first_diff(solo, group, i, len(p)))
        out[name] = {"ns": ns, "width": width, "first_diff": res}
    return out


def _timed_prefill(engine, spec) -> tuple:
    """Open `spec`'s row, time its whole prefill (device work included), close it unreused:
    (RowOpened, ms)."""
    opened = engine.open_row(spec)
    t = time.perf_counter()
    while engine.prefill(spec.row_id).remaining:
        pass
    mx.synchronize()
    ms = round(1e3 * (time.perf_counter() - t), 2)
    engine.close_row(spec.row_id)
    return opened, ms


def hit_section(model, vocab: int, gen: int = 24) -> dict:
    """After a prompt-cache hit: greedy tokens of the suffix prefilled with fused attention and
    unfused (matmuls) against a cold run, and each one's first-time cost at new offsets."""
    from cache.prompt_cache import PromptCache
    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec
    from model.options import EngineOptions
    from tests.engine_helpers import generate_tokens

    system = [(13 * j) % (vocab - 10) + 5 for j in range(1000)]
    seed = RowSpec(0, tuple(system + [7, 8]), SamplingParams(), 2)
    out: dict = {}
    for name, unfused in (("fused", False), ("unfused", True)):
        cold = Engine(model, eos_token_ids=[], options=EngineOptions(unfused_hit_prefill=False))
        hot = Engine(
            model,
            eos_token_ids=[],
            prompt_cache=PromptCache(1 << 32),
            options=EngineOptions(unfused_hit_prefill=unfused),
        )
        generate_tokens(hot, [seed], reusable=True)
        rows = []
        for i, n in enumerate((23, 37, 50, 81, 120)):
            extra = [(29 * n + 3 * j + (5 if unfused else 0)) % (vocab - 10) + 5 for j in range(n)]
            spec = RowSpec(10 + i, tuple(system + extra), SamplingParams(), gen)
            expected = generate_tokens(cold, [spec])[spec.row_id]
            opened, prefill_ms = _timed_prefill(hot, spec)
            got = generate_tokens(hot, [spec])[spec.row_id]
            rows.append(
                {
                    "suffix": n,
                    "cached": opened.cached_tokens,
                    "first_prefill_ms": prefill_ms,
                    "equal_to_cold": got == expected,
                    "first_mismatch": _first_mismatch(got, expected),
                }
            )
        out[name] = rows
    return out


def longdecode_section(model, vocab: int, steps: int = 700) -> dict:
    """One row decoding past several 256-token KV growth steps: per-step times, and the steps
    that took over 4x the median with the context length they ran at. On CUDA, MLX's decode
    attention for k >= 256 is a cuDNN graph keyed by the KV buffer's capacity, which grows in
    256-token steps — a new graph each time, if the suspicion holds."""
    import statistics

    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec

    engine = Engine(model, eos_token_ids=[])
    prompt = tuple((7 * j) % (vocab - 10) + 5 for j in range(200))
    engine.open_row(RowSpec(1, prompt, SamplingParams(), steps + 10))
    while engine.prefill(1).remaining:
        pass
    engine.join(1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.close_row(1)
    median = statistics.median(times)
    slow = [{"context": len(prompt) + i, "ms": round(1e3 * dt, 2)} for i, dt in enumerate(times) if dt > 4 * median]
    return {"median_ms": round(1e3 * median, 3), "slow_steps": slow}


def hitshape_section(model, vocab: int) -> dict:
    """What a prefill after a prompt-cache hit pays the first time, split by which shape is new:
    the suffix length M (the GEMMs' rows), the attention's k length K, both, or neither (the
    same prompts again). The engine's defaults (on CUDA: unfused attention after a hit)."""
    import os

    from cache.prompt_cache import PromptCache
    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec
    from tests.engine_helpers import generate_tokens

    base = [(13 * j) % (vocab - 10) + 5 for j in range(1400)]
    hot = Engine(model, eos_token_ids=[], prompt_cache=PromptCache(1 << 32))
    warm = os.environ.get("HITSHAPE_WARM_UP", "1") != "0"
    t = time.perf_counter()
    if warm:  # as the server starts: HIT_WARM_WIDTHS among the shapes met
        hot.warm_up(1)
    warm_up_s = round(time.perf_counter() - t, 2)
    generate_tokens(hot, [RowSpec(0, tuple(base + [7, 8]), SamplingParams(), 2)], reusable=True)
    rid = [100]

    def one(prefix: int, suffix: int, salt: int) -> dict:
        rid[0] += 1
        extra = [(31 * salt + 3 * j + 1) % (vocab - 10) + 5 for j in range(suffix)]
        if extra[0] == base[prefix]:
            extra[0] = (extra[0] + 1 - 5) % (vocab - 10) + 5
        spec = RowSpec(rid[0], tuple(base[:prefix] + extra), SamplingParams(), 1)
        opened, ms = _timed_prefill(hot, spec)
        return {"cached": opened.cached_tokens, "suffix": suffix, "ms": ms}

    new_both = [(1000, n, n) for n in (23, 37, 50, 81)]
    out = {
        "warm_up": warm,
        "warm_up_s": warm_up_s,
        "new_M_new_K": [one(*c) for c in new_both],
        "same_M_new_K": [one(p, 40, p) for p in (1010, 1060, 1110, 1160)],
        "new_M_same_K": [one(1100 - n, n, n + 1) for n in (24, 38, 52, 66)],
        "again": [one(*c) for c in new_both],
    }
    return out


def capacity_section(model, vocab: int, steps: int = 600) -> dict:
    """What the ~0.8 s decode stalls at each 256-token KV growth are keyed by: one row past
    several growths, the same again (a per-shape cache would make it free), then 8 rows (per
    batch size?), then 8 again; plus the raw cost of allocating and first-writing a new-size
    buffer. The engine's warm-up runs first, meeting the capacities up to the device's default
    warm_decode_capacity (none on the CPU)."""
    import statistics

    from model.engine.engine import Engine
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec

    engine = Engine(model, eos_token_ids=[])
    out: dict = {}
    t = time.perf_counter()
    engine.warm_up(8)
    out["warm_up_s"] = round(time.perf_counter() - t, 2)
    out["warm_decode_capacity"] = engine.options.warm_decode_capacity

    def run(rows: int, tag: int) -> dict:
        ids = [1000 * tag + r for r in range(rows)]
        for rid in ids:
            prompt = tuple((7 * j + rid) % (vocab - 10) + 5 for j in range(200))
            engine.open_row(RowSpec(rid, prompt, SamplingParams(), steps + 10))
            while engine.prefill(rid).remaining:
                pass
            engine.join(rid)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        for rid in ids:
            engine.close_row(rid)
        median = statistics.median(times)
        slow = [{"context": 200 + i, "ms": round(1e3 * dt, 1)} for i, dt in enumerate(times) if dt > 4 * median]
        return {
            "rows": rows,
            "median_ms": round(1e3 * median, 2),
            "slow_steps": slow,
            "slow_total_ms": round(sum(x["ms"] for x in slow), 1),
        }

    out["b1"] = run(1, 1)
    out["b1_again"] = run(1, 2)
    out["b8"] = run(8, 3)
    out["b8_again"] = run(8, 4)
    alloc = []
    for n in (1024, 1280, 1536, 1024, 1280):
        a = timed(lambda: mx.zeros((1, 8, n, 128), mx.bfloat16))
        alloc.append({"capacity": n, "zeros_ms": a})
    out["alloc"] = alloc
    return out


def _first_mismatch(got: list[int], expected: list[int]) -> int | None:
    return next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path)
    p.add_argument("--sections", default="sdpa,gemm,prefill,exact,rowdiff,hit,longdecode")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sections = args.sections.split(",")
    result: dict = {"device": str(mx.default_device())}
    model = vocab = None
    if args.model:
        loaded = load_model(args.model)
        model, vocab = loaded.model, int(loaded.config.raw.get("vocab_size") or 1000)
    for name in sections:
        t = time.perf_counter()
        if name == "sdpa":
            result[name] = sdpa_section()
        elif name == "gemm":
            result[name] = gemm_section()
        elif name == "prefill":
            result[name] = prefill_section(model, vocab)
        elif name == "hitshape":
            result[name] = hitshape_section(model, vocab)
        elif name == "capacity":
            result[name] = capacity_section(model, vocab)
        elif name == "longdecode":
            result[name] = longdecode_section(model, vocab)
        elif name == "hit":
            result[name] = hit_section(model, vocab)
        elif name == "rowdiff":
            result[name] = rowdiff_section(model, vocab)
        elif name == "exact":
            result[name] = exact_section(model, vocab)
        print(name, f"{time.perf_counter() - t:.1f}s", json.dumps(result[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
