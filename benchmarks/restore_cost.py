"""Where a warm restart's SSD restore spends its time, at a real model's KV shape, no model needed.

    python benchmarks/restore_cost.py [--layers 28 --kv-heads 8 --head-dim 128 --tokens 4088] [--out F]

Writes one entry of random bf16 KV (the Qwen3-0.6B shape by default: 470 MB at 4088 tokens)
through the real spill path (spill_item → SsdStore writer → commit), then restores it on a fresh
store the way a restarted server does (TieredPromptCache.take), several times, and splits each
restore into: the read (pread + sha256 on the pool), the import (numpy → mx.array + eval), and the
first use on the device (one appended token + attention over the restored keys, as the first
decode step does). The file is in the OS page cache, as after a process restart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import cache.ssd_store as ssd_store  # noqa: E402
from cache.ssd_identity import Identity  # noqa: E402
from cache.ssd_store import SsdStore  # noqa: E402
from cache.tiered import TieredPromptCache, spill_item  # noqa: E402
from model.kv.cache import KVCache  # noqa: E402


def import_variants(count: int, shape: tuple[int, ...]) -> dict:
    """Host bytes → MLX arrays usable on the device, several ways (ms for all `count` tensors,
    then the first device use): what bounds the import — one thread's memcpy, or first-touch
    faults on the allocator's (on CUDA: managed) memory?"""
    import concurrent.futures

    src = [np.random.default_rng(i).integers(0, 1 << 16, size=shape, dtype=np.uint16) for i in range(count)]
    pool = concurrent.futures.ThreadPoolExecutor(8)
    out = {}

    def first_use(arrays) -> float:
        t0 = time.perf_counter()
        mx.eval([a.astype(mx.float32).sum() for a in arrays])
        return round((time.perf_counter() - t0) * 1e3, 1)

    def variant(name, make) -> None:
        mx.clear_cache()
        t0 = time.perf_counter()
        arrays = make()
        mx.eval(arrays)
        made = round((time.perf_counter() - t0) * 1e3, 1)
        out[name] = {"import_ms": made, "first_use_ms": first_use(arrays)}
        print(f"import {name:28} {made:7.1f} ms, first device use {out[name]['first_use_ms']:6.1f} ms", flush=True)

    t0 = time.perf_counter()
    copies = [s.copy() for s in src]
    out["numpy_copy_1thread_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    t0 = time.perf_counter()
    copies = list(pool.map(lambda s: s.copy(), src))
    out["numpy_copy_8threads_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    del copies
    print(f"numpy copy: 1 thread {out['numpy_copy_1thread_ms']} ms, 8 threads {out['numpy_copy_8threads_ms']} ms")
    variant("mx.array per tensor", lambda: [mx.array(s) for s in src])
    variant("mx.array per tensor, pool", lambda: list(pool.map(mx.array, src)))

    def into(stream):
        dst = [mx.zeros(shape, mx.uint16, stream=stream) for _ in src]
        mx.eval(dst)
        list(pool.map(lambda p: np.copyto(np.asarray(p[0]), p[1]), zip(dst, src)))
        return dst

    variant("zeros(cpu) + copyto, pool", lambda: into(mx.cpu))
    variant("zeros(gpu) + copyto, pool", lambda: into(mx.default_device()))
    big = np.concatenate([s.reshape(-1) for s in src])
    variant("one mx.array, split", lambda big=big: [a.reshape(shape) for a in mx.split(mx.array(big), count)])
    del big
    pool.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4088)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    caches = []
    for i in range(args.layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
        caches.append(c)
    mx.eval([c.state for c in caches])
    tokens = tuple(range(1, args.tokens + 1))
    identity = Identity("bench", "f" * 64, "bfloat16", "t" * 64)
    results: dict = {
        "shape": list(shape),
        "layers": args.layers,
        "threads": ssd_store.RESTORE_THREADS,
        "device": str(mx.default_device()),
    }
    with tempfile.TemporaryDirectory(dir=str(Path.home())) as tmp:
        store = SsdStore(Path(tmp), identity, max_bytes=64 << 30).open()
        started = time.perf_counter()
        item = spill_item("", tokens, caches)
        writer = store.begin(item)
        while writer.write_next():
            pass
        assert writer.commit()
        results["write_s"] = time.perf_counter() - started
        results["bytes"] = store.nbytes
        store.close()
        del caches, item

        for verify in (True, False):
            rows = []
            for _ in range(args.repeats):
                store = SsdStore(Path(tmp), identity, max_bytes=64 << 30, verify=verify).open()
                tiered = TieredPromptCache(8 << 30, store)
                read_s = []
                real_read = store.read

                def timed_read(entry, _real=real_read, _acc=read_s, **kw):
                    t0 = time.perf_counter()
                    out = _real(entry, **kw)
                    _acc.append(time.perf_counter() - t0)
                    return out

                store.read = timed_read  # type: ignore[method-assign]
                t0 = time.perf_counter()
                restored, usable = tiered.take(tokens + (7,))
                take_s = time.perf_counter() - t0
                assert restored is not None and usable == args.tokens, usable
                # the first decode step's use of the restored KV: append a token, attend over all keys
                t0 = time.perf_counter()
                q = mx.random.normal((1, args.kv_heads * 2, 1, args.head_dim)).astype(mx.bfloat16)
                kv = mx.random.normal((1, args.kv_heads, 1, args.head_dim)).astype(mx.bfloat16)
                outs = []
                for c in restored:
                    k, v = c.update_and_fetch(kv, kv)
                    outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1))
                mx.eval(outs)
                first_use_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                outs = [
                    mx.fast.scaled_dot_product_attention(
                        q, c.keys[..., : c.offset, :], c.values[..., : c.offset, :], scale=0.1
                    )
                    for c in restored
                ]
                mx.eval(outs)
                again_s = time.perf_counter() - t0
                rows.append(
                    {
                        "take_s": take_s,
                        "read_s": read_s[0],
                        "import_eval_s": take_s - read_s[0],
                        "first_use_s": first_use_s,
                        "again_s": again_s,
                    }
                )
                store.close()
                del restored, outs
                mx.clear_cache()
            results["verify" if verify else "no_verify"] = rows
            for r in rows:
                print(
                    f"verify={verify!s:5} take {r['take_s'] * 1e3:7.1f} ms = read {r['read_s'] * 1e3:7.1f} + "
                    f"import/eval {r['import_eval_s'] * 1e3:6.1f}; first use {r['first_use_s'] * 1e3:6.1f} ms "
                    f"(again {r['again_s'] * 1e3:5.1f})",
                    flush=True,
                )
    results["import_variants"] = import_variants(args.layers * 2, shape)
    print(
        f"{results['bytes'] / 2**20:.0f} MiB on disk, written in {results['write_s']:.2f} s; "
        f"{results['threads']} restore threads"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
