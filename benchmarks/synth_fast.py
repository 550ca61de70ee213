"""Random-weight model directories at real shapes, fast: weights drawn with MLX on the default
device (the GPU where there is one) instead of numpy on one CPU core.

Same tensor names, gains and special-row scaling as `tests.fixtures.synth.write_model_dir` (only the
random stream differs), written through synth's own writer, so config, tokenizer, quantization
layout and safetensors format are exactly what the tests use. Only shapes matter for speed.

    from benchmarks.synth_fast import fast_model_dir
    fast_model_dir(path, dtype="bfloat16", quant="q4", **SHAPES["llama3-8b"])
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

if __name__ == "__main__":  # run as a script: the repository root is not on sys.path yet
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures import synth  # noqa: E402


def _fast_tensors(plan: Any, rng: Any) -> dict[str, mx.array]:
    del rng  # numpy's; MLX draws here
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[plan.dtype]
    key = [mx.random.key(0)]

    def normal(shape: tuple[int, ...], std: float) -> mx.array:
        key[0], sub = mx.random.split(key[0])
        out = mx.random.normal(shape, dtype=dtype, key=sub) * std
        mx.eval(out)
        return out

    def norm_weight(size: int) -> mx.array:
        return (1.0 + normal((size,), 0.05)).astype(dtype)

    def rows_zeroed(rows: mx.array) -> mx.array:
        keep = (mx.arange(rows.shape[0]) < plan.tokens.size)[:, None]
        return mx.where(keep, rows, mx.zeros_like(rows))

    def output_rows(rows: mx.array) -> mx.array:
        scale = mx.ones((rows.shape[0], 1), dtype=dtype)
        special = sorted(plan.tokens.special_ids)
        if special:
            scale[mx.array(special)] = synth._SPECIAL_TOKEN_OUTPUT_SCALE
        out = rows_zeroed(rows * scale)
        mx.eval(out)
        return out

    h = plan.hidden_size
    tensors: dict[str, mx.array] = {"model.embed_tokens.weight": rows_zeroed(normal((plan.vocab_size, h), 1.0))}
    modules = synth._linear_modules(plan)
    for i in range(plan.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight(h)
        for module, out_f, in_f in modules[7 * i : 7 * i + 7]:
            gain = synth._RESIDUAL_GAIN if module.endswith(("o_proj", "down_proj")) else 1.0
            if module.endswith(("q_proj", "k_proj")) and not plan.family.qk_norm:
                gain = synth._QK_GAIN
            tensors[f"{module}.weight"] = normal(synth._weight_shape(plan, module, out_f, in_f), gain / math.sqrt(in_f))
            params = plan.quantization.params_for(module) if plan.quantization is not None else None
            if params is not None and ".switch_mlp." in module:  # quantized as drawn: the float experts never all live
                w = tensors[f"{module}.weight"]
                tensors[f"{module}.weight"], tensors[f"{module}.scales"], tensors[f"{module}.biases"] = mx.quantize(
                    w, group_size=params[0], bits=params[1]
                )
                mx.eval(tensors[f"{module}.weight"], tensors[f"{module}.scales"], tensors[f"{module}.biases"])
                del w
            if plan.family.qkv_bias and module.endswith(("q_proj", "k_proj", "v_proj")):
                tensors[f"{module}.bias"] = normal((out_f,), 0.2)
            if module.endswith("o_proj") and plan.family.qk_norm:
                tensors[f"{p}.self_attn.q_norm.weight"] = norm_weight(plan.head_dim) * synth._QK_GAIN
                tensors[f"{p}.self_attn.k_norm.weight"] = norm_weight(plan.head_dim) * synth._QK_GAIN
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight(h)
    for module, experts, _ in synth._router_modules(plan):
        tensors[f"{module}.weight"] = normal((experts, h), 1.0 / math.sqrt(h))
    signs = mx.where(mx.random.uniform(shape=(h,), key=mx.random.key(1)) < 0.5, -1.0, 1.0).astype(dtype)
    tensors["model.norm.weight"] = norm_weight(h) * signs
    if not plan.tie_word_embeddings:
        tensors["lm_head.weight"] = output_rows(normal((plan.vocab_size, h), 1.0))
    else:
        tensors["model.embed_tokens.weight"] = output_rows(tensors["model.embed_tokens.weight"])
    return tensors


def fast_model_dir(path: Path | str, **kw: Any) -> Path:
    """`write_model_dir`'s arguments; returns the directory. Prints how long it took."""
    t0 = time.perf_counter()
    out = synth._write(path, _fast_tensors, **kw)
    print(f"synth_fast: wrote {out} in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


SHAPES = {
    # Real architectures, random weights (only shapes matter for speed).
    "qwen3-0.6b": dict(
        family="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "llama3-8b": dict(
        family="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_scaling="llama3",
        max_position_embeddings=131072,
    ),
    # Qwen3-30B-A3B's config.json: 128 experts, 8 per token, all layers sparse.
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        extra_config=dict(
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        ),
    ),
    "cpu-small": dict(
        family="qwen3",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # The server's own per-token host work, with the engine nearly free (as on a fast GPU).
    "cpu-tiny": dict(
        family="qwen3",
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
    "cpu-medium": dict(
        family="qwen3",
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


if __name__ == "__main__":  # python benchmarks/synth_fast.py DIR SHAPE DTYPE QUANT|none [LAYERS]
    target, shape_name, dtype_name, quant_name = sys.argv[1:5]
    shape = dict(SHAPES[shape_name])
    if len(sys.argv) > 5:
        shape["num_hidden_layers"] = int(sys.argv[5])
    fast_model_dir(target, dtype=dtype_name, quant=None if quant_name == "none" else quant_name, **shape)
