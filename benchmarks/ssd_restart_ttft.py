"""Warm-restart TTFT (the prefix restored from the SSD tier) vs cold TTFT, for a >= 4k-token prompt.

    python benchmarks/ssd_restart_ttft.py [--tokens 4096] [--hidden 256] [--layers 4] [--no-verify]

Before the "restart": an engine with the tiered cache runs turn 1 (a --tokens prompt plus a few
generated tokens) and its RAM entry is written to a fresh SSD directory exactly as the spill
queue writes it (snapshot on the engine's thread, pieces + commit). The "restart" closes that
store and opens a new one on the same directory (start-up scan, index), with an empty RAM tier
and a new Engine — what a new process sees, minus the model load. Turn 2 = turn 1's prompt +
its reply + 32 new tokens.

TTFT = open_row (take: SSD lookup, read, hash check, arrays) + every prefill chunk + join (token
0 read back). Cold = the same turn-2 prompt on a cache-less engine sharing the model. Best of
--repeats after a warm-up. Greedy outputs are compared. The file is in the OS page cache (it was
just written), as after a process restart; a reboot adds the disk's read time (size printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # production's CPU BLAS, before anything imports mlx (see model/load/blas.py)
    from model.load.blas import preload_optimized_blas

    BLAS = preload_optimized_blas().log_line()
except Exception as e:  # noqa: BLE001 - a benchmark still runs on the bundled BLAS
    BLAS = f"BLAS: bundled ({e.__class__.__name__})"

import numpy as np  # noqa: E402

from cache.ssd_identity import Identity, model_fingerprint, scheme_key, tokenizer_hash  # noqa: E402
from cache.ssd_store import SsdStore  # noqa: E402
from cache.tiered import TieredPromptCache  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402
from tests.fixtures.synth import write_model_dir  # noqa: E402


def ttft(engine: Engine, row_id: int, prompt: tuple[int, ...], max_tokens: int = 8) -> tuple[float, int, list[int]]:
    """(seconds to token 0, cached_tokens, greedy tokens); the row is closed (not reusable)."""
    start = time.perf_counter()
    opened = engine.open_row(RowSpec(row_id, prompt, SamplingParams(), max_tokens))
    while engine.prefill(row_id).remaining:
        pass
    first = engine.join(row_id)
    elapsed = time.perf_counter() - start
    out = [first.token]
    while len(out) < max_tokens:
        out += [t.token for t in engine.step()]
    engine.close_row(row_id)
    return elapsed, opened.cached_tokens, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--no-verify", action="store_true", help="skip the restore's tensor hash check")
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
            dtype=args.dtype,
            max_position_embeddings=max(8192, 2 * args.tokens),
        )
        lm = load_model(model_dir)
        options = EngineOptions(prefill_chunk=args.prefill_chunk)
        identity = Identity(
            lm.name,
            model_fingerprint(model_dir),
            scheme_key(str(lm.kv_dtype).rsplit(".", 1)[-1]),
            tokenizer_hash(model_dir),
        )
        rng = np.random.default_rng(0)
        turn1 = tuple(int(t) for t in rng.integers(1, 500, args.tokens))
        ssd = Path(tmp) / "ssd"

        # -- before the restart: turn 1, then its entry written as the spill queue writes it
        store = SsdStore(ssd, identity, max_bytes=64 << 30).open()
        cache = TieredPromptCache(8 << 30, store)
        engine = Engine(lm.model, eos_token_ids=[], prompt_cache=cache, options=options)
        _, _, reply = ttft(engine, 1, turn1)
        # ttft() closed the row non-reusable; put turn 1's prompt KV the way a finished row would.
        engine.open_row(RowSpec(2, turn1 + tuple(reply), SamplingParams(), 1))
        while engine.prefill(2).remaining:
            pass
        engine.join(2)
        engine.close_row(2, reusable=True)
        ((ns, tokens),) = [k for k in cache.keys() if len(k[1]) >= args.tokens]
        started = time.perf_counter()
        item = cache.snapshot(tokens, ns)
        snapshot_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        writer = store.begin(item)
        while writer.write_next():
            pass
        assert writer.commit()
        write_s = time.perf_counter() - started
        size = store.nbytes
        store.close()
        del engine, cache, item

        # -- the restart: a new store (scan + index), an empty RAM tier, a new engine
        turn2 = tuple(tokens) + tuple(int(t) for t in rng.integers(1, 500, 32))
        warm_times, cold_times = [], []
        warm_out = cold_out = None
        restore_ms = []
        scan_ms = []
        for r in range(args.repeats + 1):
            started = time.perf_counter()
            store = SsdStore(ssd, identity, max_bytes=64 << 30, verify=not args.no_verify).open()
            scan_ms.append((time.perf_counter() - started) * 1000)
            cache = TieredPromptCache(8 << 30, store)
            warm = Engine(lm.model, eos_token_ids=[], prompt_cache=cache, options=options)
            t, cached, warm_out = ttft(warm, 10 + r, turn2)
            assert cached == len(tokens) and cache.restores == 1, (cached, cache.restores)
            restore_ms.append(cache.restore_ms_last)
            store.close()
            cold = Engine(lm.model, eos_token_ids=[], options=options)
            tc, cached_cold, cold_out = ttft(cold, 100 + r, turn2)
            assert cached_cold == 0
            if r:  # the first round is the warm-up
                warm_times.append(t)
                cold_times.append(tc)

    warm_s, cold_s = min(warm_times), min(cold_times)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.dtype}; turn-2 prompt {len(turn2)} tokens "
        f"({len(tokens)} restorable), prefill chunk {args.prefill_chunk}"
    )
    print(
        f"SSD entry: {size / 2**20:.1f} MiB; snapshot on the engine thread {snapshot_ms:.2f} ms; "
        f"write {write_s * 1000:.0f} ms ({size / 2**20 / write_s:.0f} MiB/s, fsync included)"
    )
    print(
        f"start-up scan {min(scan_ms):.1f} ms; restore {min(restore_ms):.1f} ms "
        f"(verify {'off' if args.no_verify else 'on'})"
    )
    print(f"cold TTFT        {cold_s * 1000:8.1f} ms")
    print(f"warm-restart TTFT {warm_s * 1000:7.1f} ms")
    print(f"ratio cold/warm  {cold_s / warm_s:8.1f}x")
    print(f"greedy output equal: {warm_out == cold_out}")
    if warm_out != cold_out:
        sys.exit(1)


if __name__ == "__main__":
    main()
