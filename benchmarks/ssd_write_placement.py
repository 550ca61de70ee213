"""Where should SSD writes run so they never delay a decode step? (docs/ssd-cache.md)

    python benchmarks/ssd_write_placement.py [--context 4096] [--steps 60] [--write-mib 256]

Two candidate placements for the spill queue's file writes:

A. on the GPU-worker thread, as jobs between steps while the engine is idle: a step (or a new
   request's open_row) that arrives during a piece waits for the whole piece;
B. on another thread, from numpy views the worker exported (zero-copy), gated per piece on the
   engine being idle: nothing waits, but a piece in flight when a request arrives competes for
   CPU / memory bandwidth with that request's steps.

Measured here, with one row decoding at --context tokens on the engine's (main) thread:
  * baseline decode step time;
  * step time while a writer thread writes pieces back to back (B, ungated: the worst case);
  * the time one piece takes on the engine thread (A: what a step would wait);
  * the engine-thread cost of the snapshot itself: zero-copy export vs a materialized copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    from model.load.blas import preload_optimized_blas

    BLAS = preload_optimized_blas().log_line()
except Exception as e:  # noqa: BLE001
    BLAS = f"BLAS: bundled ({e.__class__.__name__})"

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from cache.spill_item import LayerMeta, SpillItem, SpillTensor  # noqa: E402
from cache.ssd_identity import Identity  # noqa: E402
from cache.ssd_store import SsdStore  # noqa: E402
from cache.ssd_writer import PIECE_BYTES  # noqa: E402
from cache.tiered import TieredPromptCache, spill_item  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from tests.fixtures.synth import write_model_dir  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def fake_item(mib: int, index: int) -> SpillItem:
    """`mib` MiB of float32 KV-shaped data (4 layers), unique tokens per index."""
    per = mib * 2**20 // (4 * 2 * 4)  # floats per tensor
    t = per // (2 * 64)
    rng = np.random.default_rng(index)
    tensors, layers = [], []
    for i in range(4):
        names = (f"l{i}.keys", f"l{i}.values")
        for name in names:
            data = rng.standard_normal((1, 2, t, 64), dtype=np.float32)
            tensors.append(SpillTensor(name, "F32", data.shape, data))
        layers.append(LayerMeta("kv", t, True, names))
    return SpillItem("", tuple(range(index * 10**7, index * 10**7 + t)), layers, tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--write-mib", type=int, default=256)
    args = ap.parse_args()
    print(BLAS)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(
            Path(tmp) / "m",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=4 * args.hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * args.context + 4 * args.steps,
        )
        lm = load_model(model_dir)
        store = SsdStore(Path(tmp) / "ssd", Identity("m", "0" * 64, "f32", "0" * 64), max_bytes=64 << 30).open()
        cache = TieredPromptCache(8 << 30, store)
        engine = Engine(lm.model, eos_token_ids=[], prompt_cache=cache)
        rng = np.random.default_rng(0)
        prompt = tuple(int(t) for t in rng.integers(1, 500, args.context))

        def decode_steps(n: int, row_id: int) -> list[float]:
            engine.open_row(RowSpec(row_id, prompt, SamplingParams(), n + 10))
            while engine.prefill(row_id).remaining:
                pass
            engine.join(row_id)
            times = []
            for _ in range(n):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.close_row(row_id, reusable=row_id == 1)
            return times

        decode_steps(5, 1)  # warm-up; puts the context into the RAM tier
        baseline = decode_steps(args.steps, 2)

        # B: a writer thread writing pieces back to back while the engine decodes.
        items = [fake_item(args.write_mib, i) for i in range(2)]
        stop = threading.Event()
        written = [0]

        def writer() -> None:
            i = 0
            while not stop.is_set():
                w = store.begin(items[i % 2])
                while not stop.is_set() and w.write_next():
                    written[0] += 1
                if stop.is_set():
                    w.abort()
                else:
                    w.commit()
                i += 1

        th = threading.Thread(target=writer)
        th.start()
        time.sleep(0.05)
        contended = decode_steps(args.steps, 3)
        stop.set()
        th.join()

        # B as shipped: the writer checks "engine idle" before every piece. A request arrives
        # while a file is being written; its TTFT and first steps overlap at most one piece.
        def ttft_and_steps(row_id: int, n: int) -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            engine.open_row(RowSpec(row_id, prompt[:1024], SamplingParams(), n + 10))
            while engine.prefill(row_id).remaining:
                pass
            engine.join(row_id)
            ttft_s = time.perf_counter() - t0
            times = []
            for _ in range(n):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.close_row(row_id)
            return ttft_s, times

        gated_ttft, gated_steps, idle_ttft, idle_steps = [], [], [], []
        for rep in range(3):
            idle_t, idle_s = ttft_and_steps(20 + rep, 20)
            idle_ttft.append(idle_t)
            idle_steps += idle_s
            stop.clear()
            busy = threading.Event()

            def gated_writer() -> None:
                w = store.begin(items[rep % 2])
                while not stop.is_set():
                    while busy.is_set() and not stop.is_set():
                        time.sleep(0.001)
                    if stop.is_set() or not w.write_next():
                        break
                w.abort()

            th = threading.Thread(target=gated_writer)
            th.start()
            time.sleep(0.2)  # the write is under way when the request arrives
            busy.set()
            t, st = ttft_and_steps(30 + rep, 20)
            gated_ttft.append(t)
            gated_steps += st
            stop.set()
            th.join()

        # A: one piece on the engine thread = the wait a step/request would see.
        piece_times = []
        w = store.begin(items[0])
        while True:
            t = time.perf_counter()
            more = w.write_next()
            piece_times.append(time.perf_counter() - t)
            if not more:
                break
        t = time.perf_counter()
        w.commit()
        commit_s = time.perf_counter() - t

        # The snapshot itself on the engine thread: zero-copy export vs a materialized copy.
        ((ns, tokens),) = [k for k in cache.keys() if len(k[1]) >= args.context][:1]
        entry_caches = cache.find_exact(tokens, ns)
        t = time.perf_counter()
        item = spill_item(ns, tokens, entry_caches)
        zero_copy_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        copies = [np.array(x.data, copy=True) for x in item.tensors]
        copy_ms = (time.perf_counter() - t) * 1000
        entry_mib = item.nbytes / 2**20
        del copies
        store.close()

    ms = lambda s: s * 1000  # noqa: E731
    print(f"context {args.context} tokens, hidden {args.hidden}, {args.layers} layers, {args.steps} steps")
    print(
        f"decode step, no writes:            p50 {ms(statistics.median(baseline)):6.2f} ms  "
        f"p99 {ms(pct(baseline, 0.99)):6.2f} ms"
    )
    print(
        f"decode step, writer thread busy:   p50 {ms(statistics.median(contended)):6.2f} ms  "
        f"p99 {ms(pct(contended, 0.99)):6.2f} ms"
        f"  ({written[0]} pieces of {PIECE_BYTES >> 20} MiB written meanwhile)"
    )
    print(
        f"request arriving mid-write, gated writer thread: TTFT {ms(min(gated_ttft)):6.1f} ms vs "
        f"{ms(min(idle_ttft)):6.1f} ms idle; its steps p50 {ms(statistics.median(gated_steps)):6.2f} ms vs "
        f"{ms(statistics.median(idle_steps)):6.2f} ms"
    )
    print(
        f"one {PIECE_BYTES >> 20} MiB piece on the engine thread: "
        f"p50 {ms(statistics.median(piece_times[:-1])):6.2f} ms  "
        f"max {ms(max(piece_times)):6.2f} ms; commit (fsync+rename) {ms(commit_s):.1f} ms"
    )
    print(
        f"snapshot of the {entry_mib:.1f} MiB entry on the engine thread: zero-copy {zero_copy_ms:.2f} ms, "
        f"materialized copy {copy_ms:.2f} ms"
    )
    mx.clear_cache()


if __name__ == "__main__":
    main()
