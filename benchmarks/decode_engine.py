"""Engine-level decode speed: our Engine vs mlx_lm.generate_step on the same weights, in one run.

Reports B=1 decode tok/s (and ms/step), the fraction of the memory-bandwidth roofline
(weights + KV bytes read per token / --bandwidth-gbs), and batched aggregate tok/s at B=8/32.

  python benchmarks/decode_engine.py --synth qwen3-0.6b --dtype bfloat16 --bandwidth-gbs 4800
  python benchmarks/decode_engine.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.blas import preload_optimized_blas  # noqa: E402

preload_optimized_blas()

import mlx.core as mx  # noqa: E402

from actors.worker_api import RowSpec  # noqa: E402
from benchmarks.serve_bench import SHAPES  # noqa: E402
from model.engine import Engine  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.params import SamplingParams  # noqa: E402


def ours_decode(engine: Engine, prompt: list[int], steps: int, batch: int) -> float:
    rows = list(range(batch))
    for r in rows:
        engine.open_row(RowSpec(r, tuple(prompt[r:] + prompt[:r]), SamplingParams(), steps + 8))
        while engine.prefill(r).remaining:
            pass
        engine.join(r)
    for _ in range(4):  # warm up
        engine.step()
    mx.synchronize()
    t0 = time.perf_counter()
    produced = 0
    while produced < steps * batch:
        produced += len(engine.step())
    elapsed = time.perf_counter() - t0
    for r in rows:
        engine.close_row(r)
    return produced / elapsed


def mlx_lm_decode(model_dir: Path, prompt: list[int], steps: int) -> float:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as ref_load

    model, _ = ref_load(model_dir)
    gen = generate_step(mx.array(prompt), model, max_tokens=steps + 4)
    for _ in range(4):
        next(gen)
    t0 = time.perf_counter()
    n = 0
    for _ in gen:
        n += 1
    return n / (time.perf_counter() - t0)


def mlx_lm_batch(model_dir: Path, prompt: list[int], steps: int, batch: int) -> float:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model as ref_load

    model, _ = ref_load(model_dir)
    gen = BatchGenerator(model, max_tokens=steps + 8, completion_batch_size=batch, prefill_batch_size=batch)
    gen.insert([prompt[r:] + prompt[:r] for r in range(batch)])
    while True:  # until every row is decoding
        _, responses = gen.next()
        if len(responses) == batch:
            break
    t0 = time.perf_counter()
    produced = 0
    while produced < steps * batch:
        _, responses = gen.next()
        if not responses:
            break
        produced += len(responses)
    rate = produced / (time.perf_counter() - t0)
    gen.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--synth", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM bandwidth for the roofline")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        from model.synth import write_model_dir

        t0 = time.perf_counter()
        model_dir = write_model_dir(Path(tmp.name) / "m", dtype=args.dtype, quant=args.quant, **SHAPES[args.synth])
        print(f"wrote {args.synth} {args.dtype} {args.quant} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    loaded = load_model(model_dir)
    engine = Engine(loaded.model, eos_token_ids=[])
    prompt = [(i * 37) % 400 + 3 for i in range(args.prompt_len)]
    kv_bytes = loaded.kv_bytes_per_token * (args.prompt_len + args.steps // 2)
    roofline = args.bandwidth_gbs * 1e9 / (loaded.weights_bytes + kv_bytes)
    result = {"model": args.synth if args.model is None else str(args.model), "dtype": args.dtype,
              "quant": args.quant, "device": str(mx.default_device()), "weights_gb": loaded.weights_bytes / 1e9,
              "roofline_tok_s": roofline}
    for b in [int(x) for x in args.batches.split(",")]:
        ours = ours_decode(engine, prompt, args.steps, b)
        ref = mlx_lm_decode(model_dir, prompt, args.steps) if b == 1 else mlx_lm_batch(model_dir, prompt, args.steps, b)
        result[f"B{b}"] = {"ours_tok_s": ours, "mlx_lm_tok_s": ref, "ratio": ours / ref}
        if b == 1:
            result["B1"].update(ours_ms_step=1000 / ours, mlx_lm_ms_step=1000 / ref,
                                ours_roofline_pct=100 * ours / roofline, mlx_lm_roofline_pct=100 * ref / roofline)
        print(f"B={b}: {result[f'B{b}']}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
