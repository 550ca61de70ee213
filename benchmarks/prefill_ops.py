"""Where one prefill forward's time goes, op by op, on the model's own layers.

Times the whole forward of B prompts of L tokens, then each stage of layer 0 evaluated on its
own (best of 5): the norms, the q/k/v products, RoPE, attention, the output product and the
MLP's products and SwiGLU. On Linux CPU this shows what a prefill costs besides BLAS (the
docs' "CPU c=8 and c=32" profile).

  python benchmarks/prefill_ops.py --synth cpu-small --dtype float32 --batch 7 --length 290
  python benchmarks/prefill_ops.py --model DIR --batch 1 --length 2048
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.load.blas import preload_optimized_blas  # noqa: E402

BLAS = preload_optimized_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from benchmarks.synth_fast import SHAPES  # noqa: E402
from model.kv.cache import make_caches  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.nn.decoder import swiglu  # noqa: E402


def best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--synth", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--length", type=int, default=290)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        from benchmarks.synth_fast import fast_model_dir

        model_dir = fast_model_dir(Path(tmp.name) / "m", dtype=args.dtype, quant=None, **SHAPES[args.synth])
    model = load_model(model_dir).model
    B, L = args.batch, args.length
    tokens = mx.array([[3 + (b * 31 + i * 7) % 400 for i in range(L)] for b in range(B)])
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dim = attn.q_proj.weight.shape[1]
    x = mx.random.normal((B, L, dim)).astype(attn.q_proj.weight.dtype)
    q, k, v = attn.project(x, 0)
    attended = attn.attend(q, k, v, "causal")
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    mx.eval(x, q, k, v, attended, gate, up)
    ms = {
        "forward (all layers, no LM head)": best_ms(lambda: model(tokens, make_caches(len(model.layers)))),
        "layer 0: input norm": best_ms(lambda: layer.input_layernorm(x)),
        "layer 0: q/k/v products": best_ms(lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]),
        "layer 0: project (products, q/k norm, RoPE)": best_ms(lambda: attn.project(x, 0)),
        "layer 0: attention (causal sdpa)": best_ms(lambda: attn.attend(q, k, v, "causal")),
        "layer 0: output product": best_ms(lambda: attn.output(attended)),
        "layer 0: MLP": best_ms(lambda: mlp(x)),
        "layer 0: MLP gate + up + down products": best_ms(
            lambda: [mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj(gate)]
        ),
        "layer 0: SwiGLU (ours)": best_ms(lambda: swiglu(gate, up)),
        "layer 0: SwiGLU (nn.silu, mlx-lm's)": best_ms(lambda: nn.silu(gate) * up),
    }
    width = max(map(len, ms))
    print(f"B={B} L={L} layers={len(model.layers)} {BLAS.log_line()}")
    for name, value in ms.items():
        print(f"  {name:<{width}} {value:8.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"batch": B, "length": L, "blas": BLAS.log_line(), "ms": ms}, indent=1))


if __name__ == "__main__":
    main()
