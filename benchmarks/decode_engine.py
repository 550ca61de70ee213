"""Engine-level decode speed: our Engine (eager and compiled decode) vs mlx-lm on the same
weights, in one process, plus a host-side profile of one decode step.

Reports, per batch size B: decode tok/s of
  ours            Engine with the compiled decode step (the default; model/engine/compiled_decode.py)
  ours_eager      Engine with EngineOptions(compile_decode=False): the eager graph (on CUDA it
                  shares the fused q/k/v and gate/up weights the compiled engine made)
  mlx_lm          B=1: mlx_lm.generate.generate_step; B>1: mlx_lm.generate.BatchGenerator
and for B=1 the fraction of the memory-bandwidth roofline (weights + mean KV bytes read per
token / --bandwidth-gbs) and a profile: host ms to build one step's graph (eager forward,
compiled forward, mlx-lm's model call), ms for an mx.eval of one step from scratch (build +
encode + device + read-back, nothing overlapped), and the pipelined step time.

  python benchmarks/decode_engine.py --synth qwen3-0.6b --dtype bfloat16 --bandwidth-gbs 4800
  python benchmarks/decode_engine.py --synth llama3-8b --dtype bfloat16 --batches 1
  python benchmarks/decode_engine.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.load.blas import preload_optimized_blas  # noqa: E402

preload_optimized_blas()

import mlx.core as mx  # noqa: E402

from benchmarks.synth_fast import SHAPES  # noqa: E402
from model.engine import engine as engine_module  # noqa: E402
from model.engine.compiled_decode import CompiledDecode  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.kv.cache import make_caches  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.nn.decoder import DecoderModel  # noqa: E402
from model.options import EngineOptions  # noqa: E402


def ours_decode(engine: Engine, prompt: list[int], steps: int, batch: int) -> tuple[float, dict]:
    """(tok/s, per-step host ms split): `dispatch` = build + async_eval of step n+1 (host),
    `read` = waiting for step n's tokens + recording them (mostly device time not hidden)."""
    rows = list(range(batch))
    for r in rows:
        engine.open_row(RowSpec(r, tuple(prompt[r:] + prompt[:r]), SamplingParams(), steps + 16))
        while engine.prefill(r).remaining:
            pass
        engine.join(r)
    for _ in range(6):  # warm up (compiles the decode stages for this batch size)
        engine.step()
    mx.synchronize()
    acc = {"dispatch": 0.0, "read": 0.0}
    dispatch, read = engine._dispatch, engine_module.read

    def timed_dispatch(inputs):
        t = time.perf_counter()
        out = dispatch(inputs)
        acc["dispatch"] += time.perf_counter() - t
        return out

    def timed_read(inflight, eos):
        t = time.perf_counter()
        out = read(inflight, eos)
        acc["read"] += time.perf_counter() - t
        return out

    engine._dispatch, engine_module.read = timed_dispatch, timed_read
    t0 = time.perf_counter()
    produced = n_steps = 0
    while produced < steps * batch:
        produced += len(engine.step())
        n_steps += 1
    elapsed = time.perf_counter() - t0
    del engine._dispatch
    engine_module.read = read
    for r in rows:
        engine.close_row(r)
    split = {f"{k}_ms": 1000 * v / n_steps for k, v in acc.items()}
    split["step_ms"] = 1000 * elapsed / n_steps
    return produced / elapsed, split


def mlx_lm_decode(model, prompt: list[int], steps: int) -> float:
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array(prompt), model, max_tokens=steps + 6)
    for _ in range(6):
        next(gen)
    t0 = time.perf_counter()
    n = 0
    for _ in gen:
        n += 1
    return n / (time.perf_counter() - t0)


def mlx_lm_batch(model, prompt: list[int], steps: int, batch: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=steps + 16, completion_batch_size=batch, prefill_batch_size=batch)
    gen.insert([prompt[r:] + prompt[:r] for r in range(batch)])
    warm = 0
    while True:  # until every row is decoding, then a few steps
        _, responses = gen.next()
        if len(responses) == batch:
            warm += 1
            if warm == 6:
                break
    mx.synchronize()
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


def best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def profile_b1(model, ref_model, prompt: list[int]) -> dict:
    """Host ms to build one B=1 decode step's graph, and ms to evaluate one from scratch."""
    from mlx_lm.models.cache import make_prompt_cache

    assert isinstance(model, DecoderModel)
    compiled = CompiledDecode(model)  # (on CUDA the engines have fused its projections already)
    out: dict = {}
    for name in ("eager", "compiled", "mlx_lm"):
        if name == "mlx_lm":
            caches = make_prompt_cache(ref_model)
            mx.eval(ref_model(mx.array(prompt)[None], cache=caches))

            def forward(tok):
                return ref_model(tok, cache=caches)[:, -1, :]
        else:
            caches = make_caches(len(model.layers))
            mx.eval(model(mx.array(prompt)[None], caches))
            if name == "eager":

                def forward(tok):
                    return model.logits(model(tok, caches)[:, -1, :])
            else:

                def forward(tok):
                    return compiled(tok, caches)

        tok = mx.array([[7]])
        builds, evals = [], []
        for i in range(24):
            t0 = time.perf_counter()
            logits = forward(tok)
            y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
            t1 = time.perf_counter()
            tok = mx.array([[y.item()]])  # eval + read-back: nothing overlapped
            t2 = time.perf_counter()
            if i >= 4:
                builds.append(t1 - t0)
                evals.append(t2 - t1)
        out[f"{name}_build_ms"] = 1000 * statistics.median(builds)
        out[f"{name}_eval_ms"] = 1000 * statistics.median(evals)
        out[f"{name}_serial_step_ms"] = out[f"{name}_build_ms"] + out[f"{name}_eval_ms"]
    return out


def parity(engine: Engine, ref_model, prompt: list[int], n: int = 48) -> dict:
    """Greedy B=1 tokens of our default engine vs mlx_lm.generate_step on this device."""
    from mlx_lm.generate import generate_step

    engine.open_row(RowSpec(999, tuple(prompt), SamplingParams(), n))
    while engine.prefill(999).remaining:
        pass
    ours = [engine.join(999).token]
    while len(ours) < n:
        ours += [t.token for t in engine.step()]
    engine.close_row(999)
    ref = [
        int(t) for t, _ in zip((tok for tok, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n)), range(n))
    ]
    same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    return {"tokens": n, "identical_prefix": same, "equal": ours[:n] == ref[:n]}


def versions() -> dict:
    import platform

    import mlx_lm

    dev = mx.default_device()
    info = {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(dev),
    }
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # noqa: BLE001
        pass
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--synth", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--skip-eager", action="store_true", help="only the default engine (no A/B variants)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant; the best is reported")
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth for the roofline")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        from benchmarks.synth_fast import fast_model_dir

        shape = dict(SHAPES[args.synth])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        model_dir = fast_model_dir(Path(tmp.name) / "m", dtype=args.dtype, quant=args.quant, **shape)
    loaded = load_model(model_dir)
    from mlx_lm.utils import load_model as ref_load

    ref_model, _ = ref_load(Path(model_dir))
    prompt = [(i * 37) % 400 + 3 for i in range(args.prompt_len)]
    kv_bytes = loaded.kv_bytes_per_token * (args.prompt_len + args.steps // 2)
    roofline = args.bandwidth_gbs * 1e9 / (loaded.weights_bytes + kv_bytes)
    result = {
        "model": args.synth if args.model is None else str(args.model),
        "layers": args.layers,
        "dtype": args.dtype,
        "quant": args.quant,
        "versions": versions(),
        "weights_gb": loaded.weights_bytes / 1e9,
        "bandwidth_gbs": args.bandwidth_gbs,
        "roofline_tok_s": roofline,
        "date": time.strftime("%Y-%m-%d"),
    }
    # ours: the default engine (compiled decode); ours_eager: the eager graph, for A/B.
    variants = {"ours": Engine(loaded.model, eos_token_ids=[])}
    if not args.skip_eager:
        variants["ours_eager"] = Engine(loaded.model, eos_token_ids=[], options=EngineOptions(compile_decode=False))
    result["parity_b1"] = parity(variants["ours"], ref_model, prompt)
    print(f"parity: {result['parity_b1']}", file=sys.stderr, flush=True)
    for b in [int(x) for x in args.batches.split(",")]:
        runs: dict[str, list[float]] = {}
        splits: dict[str, dict] = {}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, engine in variants.items():
                rate, split = ours_decode(engine, prompt, args.steps, b)
                runs.setdefault(name, []).append(rate)
                if rate >= max(runs[name]):
                    splits[name] = split
            rate = (
                mlx_lm_decode(ref_model, prompt, args.steps)
                if b == 1
                else mlx_lm_batch(ref_model, prompt, args.steps, b)
            )
            runs.setdefault("mlx_lm", []).append(rate)
        row = {f"{name}_tok_s": max(v) for name, v in runs.items()}
        row["runs"] = runs
        row["split_ms"] = splits
        row["ratio"] = row["ours_tok_s"] / row["mlx_lm_tok_s"]
        if b == 1:
            for name in runs:
                row[f"{name}_ms_step"] = 1000 / row[f"{name}_tok_s"]
                row[f"{name}_roofline_pct"] = 100 * row[f"{name}_tok_s"] / roofline
            row["profile"] = profile_b1(loaded.model, ref_model, prompt)
        result[f"B{b}"] = row
        print(f"B={b}: {json.dumps(row)}", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
