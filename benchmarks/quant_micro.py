"""Quantized products alone on a CUDA GPU: our kernel (model/quant_kernel.py) against MLX's
`quantized_matmul` / `gather_qmm` and a bf16 matmul of the same shape, per row count, with the
bandwidth roofline of the weight bytes each reads.

    python benchmarks/quant_micro.py --bandwidth-gbs 3350 --out micro.json [--search] [--moe]

Dense shapes: the Llama-3-8B linears (q, k/v, o, gate/up, down, LM head); `--search` times every
tiling per shape at 32 rows first (quant_kernel.tune). `--moe`: Qwen3-30B-A3B's expert products
(128 experts, top 8) for 2-64 tokens, sorted pairs, ours vs `gather_qmm(sorted_indices=True)`; and
for a prefill chunk (`--moe-prefill`, default 2048 tokens) `gather_qmm` vs dequantize + `gather_mm`.
`--kv`: decode attention over 4k/16k-token caches, 8-bit and 4-bit (model/kv/quant_kernel.py)
against bf16 SDPA over a bf16 cache and the quantized cache's dequantizing path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import quant_kernel, quant_tune  # noqa: E402

DENSE = {
    "q/o 4096x4096": (4096, 4096),
    "k/v 1024x4096": (1024, 4096),
    "gate/up 14336x4096": (14336, 4096),
    "down 4096x14336": (4096, 14336),
    "lm_head 128256x4096": (128256, 4096),
}
MOE = {"gate/up 128x768x2048": (128, 768, 2048), "down 128x2048x768": (128, 2048, 768)}


def timed(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / reps


def dense(args: argparse.Namespace) -> dict:
    out: dict = {}
    rows = [int(r) for r in args.rows.split(",")]
    for bits in [int(b) for b in args.bits.split(",")]:
        for name, (n, k) in DENSE.items():
            key = mx.random.key(n + k)
            w = (mx.random.normal((n, k), key=key) * 0.02).astype(mx.bfloat16)
            q, s, b = mx.quantize(w, group_size=args.group_size, bits=bits)
            mx.eval(w, q, s, b)
            qbytes = q.nbytes + s.nbytes + b.nbytes
            entry: dict = {"weight_bytes": qbytes, "bf16_bytes": w.nbytes}
            if args.search:
                tuned = quant_tune.tune([(n, k, bits, args.group_size, mx.bfloat16)], rows=(32,), search=True)
                entry["tilings_32_rows_s"] = next(iter(tuned.values())).get("tilings_32_rows")
            cfg = quant_kernel.config_for(n, k, bits)
            entry["config"] = str(cfg)
            for m in rows:
                x = mx.random.normal((m, k), key=key).astype(mx.bfloat16)
                t_mlx = timed(lambda: mx.quantized_matmul(x, q, s, b, group_size=args.group_size, bits=bits))
                t_bf16 = timed(lambda: x @ w.T)
                t_ours = timed(lambda: quant_kernel.qmm(x, q, s, b, bits)) if cfg is not None else float("nan")
                roof = qbytes / (args.bandwidth_gbs * 1e9)
                entry[str(m)] = {
                    "ours_us": 1e6 * t_ours,
                    "mlx_qmm_us": 1e6 * t_mlx,
                    "bf16_us": 1e6 * t_bf16,
                    "roofline_us": 1e6 * roof,
                    "ours_pct_roofline": 100 * roof / t_ours,
                    "ours_vs_mlx": t_mlx / t_ours,
                    "ours_vs_bf16": t_bf16 / t_ours,
                }
                print(f"q{bits} {name} M={m}: {json.dumps(entry[str(m)])}", file=sys.stderr, flush=True)
            out[f"q{bits} {name}"] = entry
    return out


def moe(args: argparse.Namespace) -> dict:
    out: dict = {}
    top = 8
    for bits in [int(b) for b in args.bits.split(",")]:
        for name, (e, n, k) in MOE.items():
            key = mx.random.key(n)
            w = (mx.random.normal((e, n, k), key=key) * 0.02).astype(mx.bfloat16)
            q, s, b = mx.quantize(w, group_size=args.group_size, bits=bits)
            mx.eval(q, s, b)
            del w
            per_expert = (q.nbytes + s.nbytes + b.nbytes) / e
            entry: dict = {"config": str(quant_kernel.gather_config_for(n, k, bits))}
            for tokens in (2, 8, 32, 64):
                x = mx.random.normal((tokens, k), key=key).astype(mx.bfloat16)
                idx = mx.argsort(mx.random.uniform(shape=(tokens, e), key=key), axis=-1)[:, :top]
                flat = idx.flatten()
                order = mx.argsort(flat)
                experts, rowmap = flat[order], order // top
                xs = x[rowmap][:, None]
                mx.eval(experts, rowmap, xs)
                used = len(set(experts.tolist()))
                t_ours = timed(
                    lambda: quant_kernel.gather_qmm(x, q, s, b, rowmap, experts, bits, rows_per_expert=min(tokens, 16))
                )
                t_mlx = timed(
                    lambda: mx.gather_qmm(
                        xs, q, s, b, rhs_indices=experts, transpose=True, group_size=args.group_size, bits=bits,
                        sorted_indices=True,
                    )
                )  # fmt: skip
                roof = used * per_expert / (args.bandwidth_gbs * 1e9)
                entry[str(tokens)] = {
                    "experts_used": used,
                    "ours_us": 1e6 * t_ours,
                    "mlx_gather_qmm_us": 1e6 * t_mlx,
                    "roofline_us": 1e6 * roof,
                    "ours_pct_roofline": 100 * roof / t_ours,
                    "ours_vs_mlx": t_mlx / t_ours,
                }
                print(f"moe q{bits} {name} T={tokens}: {json.dumps(entry[str(tokens)])}", file=sys.stderr, flush=True)
            for tokens in args.moe_prefill:
                x = mx.random.normal((tokens, k), key=key).astype(mx.bfloat16)
                entry[str(tokens)] = _moe_prefill(x, q, s, b, e, top, args, bits)
                print(f"moe q{bits} {name} T={tokens}: {json.dumps(entry[str(tokens)])}", file=sys.stderr, flush=True)
            out[f"moe q{bits} {name}"] = entry
    return out


def _moe_prefill(x, q, s, b, e: int, top: int, args: argparse.Namespace, bits: int) -> dict:  # type: ignore[no-untyped-def]
    """A prefill chunk's routed products (past the kernel's 64 rows): MLX's `gather_qmm` over the
    sorted pairs (on CUDA one one-row GEMM per pair) against dequantizing every expert and MLX's
    `gather_mm` (on CUDA a grouped GEMM for sorted one-row pairs)."""
    gs, tokens = args.group_size, x.shape[0]
    idx = mx.argsort(mx.random.uniform(shape=(tokens, e), key=mx.random.key(tokens)), axis=-1)[:, :top]
    flat = idx.flatten()
    order = mx.argsort(flat)
    experts, xs = flat[order], x[order // top][:, None]
    mx.eval(experts, xs)
    t_mlx = timed(
        lambda: mx.gather_qmm(xs, q, s, b, rhs_indices=experts, transpose=True, group_size=gs, bits=bits,
                              sorted_indices=True), reps=5)  # fmt: skip
    t_deq = timed(
        lambda: mx.gather_mm(xs, mx.dequantize(q, s, b, group_size=gs, bits=bits).swapaxes(-1, -2),
                             rhs_indices=experts, sorted_indices=True), reps=5)  # fmt: skip
    return {"mlx_gather_qmm_us": 1e6 * t_mlx, "dequantize_gather_mm_us": 1e6 * t_deq, "deq_vs_mlx": t_mlx / t_deq}


def kv(args: argparse.Namespace) -> dict:
    """Decode attention at B=8, 32/8 heads, head_dim 128: bf16 SDPA over a bf16 cache ("off"),
    the quantized cache's previous CUDA path (dequantize, then matmuls) and our fused kernel."""
    from model.kv import quant_kernel as kv_quant_kernel
    from model.kv.quant import quantized_attention
    from model.kv.scheme import LayerQuant

    out: dict = {}
    B, hq, hkv, D = 8, 32, 8, 128
    for T in (4096, 16384):
        q = mx.random.normal((B, hq, 1, D)).astype(mx.bfloat16)
        k = mx.random.normal((B, hkv, T, D)).astype(mx.bfloat16)
        v = mx.random.normal((B, hkv, T, D)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        t_off = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5))
        entry: dict = {"off_bf16_us": 1e6 * t_off, "off_roofline_us": 1e6 * 2 * k.nbytes / (args.bandwidth_gbs * 1e9)}
        for bits in (8, 4):
            quant = LayerQuant(bits=bits, group_size=64)
            kq = mx.quantize(k, group_size=64, bits=bits)
            vq = mx.quantize(v, group_size=64, bits=bits)
            mx.eval(kq, vq)
            nbytes = sum(a.nbytes for a in (*kq, *vq))
            quant_kernel.ENABLED = False
            t_old = timed(lambda: quantized_attention(q, kq, vq, D**-0.5, None, quant), reps=5)
            quant_kernel.ENABLED = True
            t_new = timed(lambda: kv_quant_kernel.decode_attention(q, kq, vq, D**-0.5, None, bits))
            roof = nbytes / (args.bandwidth_gbs * 1e9)
            entry[f"q{bits}"] = {
                "kernel_us": 1e6 * t_new,
                "dequantize_path_us": 1e6 * t_old,
                "roofline_us": 1e6 * roof,
                "kernel_pct_roofline": 100 * roof / t_new,
                "kernel_vs_off": t_off / t_new,
            }
        out[f"T{T}"] = entry
        print(f"kv T={T}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth-gbs", type=float, default=3350.0)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", default="1,2,8,16,32,64")
    p.add_argument("--search", action="store_true")
    p.add_argument("--moe", action="store_true")
    p.add_argument(
        "--moe-prefill", type=lambda v: [int(t) for t in v.split(",") if t], default=[2048],
        help="prefill token counts for the MoE A/B: gather_qmm vs dequantize + gather_mm ('' for none)",
    )  # fmt: skip
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--kv", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result: dict = {"device": mx.device_info(), "bandwidth_gbs": args.bandwidth_gbs}
    t0 = time.perf_counter()
    if not args.no_dense:
        result["dense"] = dense(args)
    if args.moe:
        result["moe"] = moe(args)
    if args.kv:
        result["kv"] = kv(args)
    result["seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
