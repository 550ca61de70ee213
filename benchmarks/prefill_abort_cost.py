"""What the abort checks between a prefill's layers cost, and how soon an abort lands.

For one model (a directory, or a synth_fast shape written to a temporary directory), alternating
rounds of a whole-prompt prefill (several chunks) under each check schedule:
  none          no checks: one evaluation per chunk (before model/engine/prefill_abort.py)
  default       what the engine does on this device (CPU: every layer, waiting; GPU: every
                GPU_EVERY layers, one checkpoint queued ahead)
  every1-ahead  every layer, one ahead
  every1-sync   every layer, waiting for it
then whether `default` leaves the KV bit for bit as `none` does, and the abort latency: a flag set
from another thread a third into a chunk, until `prefill` returns, against a B=1 decode step.

  python benchmarks/prefill_abort_cost.py --synth qwen3-0.6b --dtype bfloat16
  python benchmarks/prefill_abort_cost.py --model DIR --chunk 2048 --chunks 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.load.blas import preload_optimized_blas  # noqa: E402

preload_optimized_blas()

import mlx.core as mx  # noqa: E402

from benchmarks.synth_fast import SHAPES, fast_model_dir  # noqa: E402
from model.engine.abort_flags import AbortFlags  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.prefill_abort import GPU_EVERY, LayerCheckpoints  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402

Schedule = Callable[[Callable[[], bool], int, bool], LayerCheckpoints]
_original = LayerCheckpoints.for_device
SCHEDULES: dict[str, Schedule] = {
    "none": lambda stop, layers, gpu: LayerCheckpoints(stop, layers, every=1 << 30),
    "default": lambda stop, layers, gpu: _original(stop, layers, gpu=gpu),
    "every1-ahead": lambda stop, layers, gpu: LayerCheckpoints(stop, layers, every=1, ahead=True),
    "every1-sync": lambda stop, layers, gpu: LayerCheckpoints(stop, layers, every=1),
}


def use(name: str) -> None:
    schedule = SCHEDULES[name]
    LayerCheckpoints.for_device = classmethod(lambda cls, stop, layers, *, gpu: schedule(stop, layers, gpu))  # type: ignore[method-assign,assignment]


def prefill_all(engine: Engine, row_id: int, prompt: tuple[int, ...]) -> float:
    engine.open_row(RowSpec(row_id, prompt, SamplingParams(), 1))
    mx.synchronize()
    started = time.perf_counter()
    while engine.prefill(row_id).remaining:
        pass
    mx.synchronize()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--synth", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    model_dir = args.model or fast_model_dir(
        tempfile.mkdtemp(prefix="abort-cost-"), dtype=args.dtype, quant=None, **SHAPES[args.synth or "cpu-small"]
    )
    model = load_model(model_dir).model
    flags = AbortFlags()
    engine = Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=args.chunk), aborts=flags)
    rng = random.Random(0)
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 1000))
    prompt = tuple(rng.randrange(3, min(vocab, 1000)) for _ in range(args.chunks * args.chunk + 1))
    report: dict = {"device": str(mx.default_device()), "layers": len(model.layers), "gpu_every": GPU_EVERY}
    report["chunk"], report["prompt_tokens"] = args.chunk, len(prompt)

    # Warm every schedule once (kernels, graphs), then alternate.
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    row = 0
    for r in range(args.rounds + 1):
        for name in SCHEDULES if r % 2 else reversed(list(SCHEDULES)):
            use(name)
            row += 1
            seconds = prefill_all(engine, row, prompt)
            engine.close_row(row)
            if r:
                times[name].append(seconds)
    report["prefill_s"] = {n: {"median": statistics.median(t), "all": t} for n, t in times.items()}

    # Bits: the default schedule's KV equals one evaluation per chunk.
    states = {}
    for name in ("none", "default"):
        use(name)
        row += 1
        prefill_all(engine, row, prompt)
        states[name] = [s[..., : c.offset, :] for c in engine.row_caches(row) for s in c.state]
        mx.eval(states[name])
        engine.close_row(row)
    report["kv_bits_equal"] = all(mx.array_equal(a, b).item() for a, b in zip(states["none"], states["default"]))

    # Abort latency: a flag set a third into the first chunk, until prefill returns.
    use("default")
    chunk_s = statistics.median(times["default"]) / args.chunks
    lat = []
    for _ in range(args.rounds):
        row += 1
        engine.open_row(RowSpec(row, prompt, SamplingParams(), 1))
        mx.synchronize()
        flagged: list[float] = []

        def flag(row_id: int = row) -> None:
            flagged.append(time.perf_counter())
            flags.add(row_id)

        timer = threading.Timer(chunk_s / 3, flag)
        timer.start()
        engine.prefill(row)
        mx.synchronize()
        returned = time.perf_counter()
        timer.join()
        engine.close_row(row)
        lat.append(returned - flagged[0] if flagged and flagged[0] < returned else float("nan"))
    report["abort_to_return_s"] = {"median": statistics.median(lat), "max": max(lat), "all": lat, "chunk_s": chunk_s}

    # A B=1 decode step, for scale.
    row += 1
    engine.open_row(RowSpec(row, prompt[:512], SamplingParams(), 100))
    while engine.prefill(row).remaining:
        pass
    engine.join(row)
    steps = []
    for _ in range(40):
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    engine.close_row(row)
    report["decode_step_s"] = statistics.median(steps[8:])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
