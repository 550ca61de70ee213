"""A batch's prefill through quantized weights on CUDA: the weights dequantized once, then one
GEMM, where that is measured faster than MLX's quantized products.

MLX's CUDA `gather_qmm` over a prefill's (token, expert) pairs runs every pair as a product of
its own one row: a 2,048-token chunk with 8 experts a token is 16,384 one-row products per
projection, each reading its expert's weights. Dequantizing the stacked experts once ([experts,
N, K] in the activation dtype, a transient of the layer's size) and `gather_mm` over the sorted
pairs (on CUDA a grouped GEMM) reads each expert once. A dense linear's `quantized_matmul` over
thousands of rows is a CUTLASS GEMM of the Ampere generation; a dequantized weight goes to the
GPU's own GEMM. Which wins depends on the shape and the token count, so it is measured at load
(`tune`, from `quant_linear.route`): token counts downwards from a full prefill chunk, the
smallest that still won becomes the shape's threshold; fewer tokens (decode steps) keep MLX's
quantized products (or the few-row kernels of model/quant_kernel.py).

Only a batch's prefill (several sequences, several tokens each) takes it: one sequence's prefill
keeps mlx-lm's exact ops, so a cold solo request's greedy tokens stay mlx-lm's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import mlx.core as mx

from model import quant_kernel
from model.quant_tune import _TOLERANCE, _queue, _rel_err, _time

log = logging.getLogger(__name__)

# (experts, N, K, bits, group size, dtype); experts 0: a dense linear's [N, K] weight.
Shape = tuple[int, int, int, int, int, Any]
Key = tuple[int, int, int, int, int, str]

# Per shape: the fewest tokens from which the dequantized path measured faster (None: never; a
# shape not measured keeps MLX's quantized products).
_thresholds: dict[Key, int | None] = {}
_weight_bytes: dict[Key, int] = {}  # the dequantized weight's size


def _key(shape: Shape) -> Key:
    e, n, k, bits, gs, dtype = shape
    return (e, n, k, bits, gs, str(dtype))


def batch_prefill(x: mx.array) -> bool:
    """Whether `x` [..., tokens, dims] is a batch's prefill: several sequences of several tokens."""
    return x.ndim >= 3 and x.shape[0] > 1 and x.shape[-2] > 1


def wins(shape: Shape, tokens: int) -> bool:
    """Whether `tokens` tokens of a batch's prefill through weights of `shape` take the
    dequantized path here (a CUDA GPU, the shape measured, at least its threshold)."""
    if not quant_kernel.available():
        return False
    threshold = _thresholds.get(_key(shape))
    return threshold is not None and tokens >= threshold


def transient_bytes() -> int:
    """What a batch's prefill chunk holds at once beyond a plain one where this path is on: three
    dequantized weights (gate, up and down, or q, k and v), the largest measured; 0 where off."""
    on = [_weight_bytes[key] for key, threshold in _thresholds.items() if threshold is not None]
    return 3 * max(on, default=0)


def expert_product(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    indices: mx.array,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    sorted_indices: bool = False,
) -> mx.array:
    """`gather_qmm(x, w, ..., rhs_indices=indices, transpose=True)` as dequantize + `gather_mm`."""
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return mx.gather_mm(x, dense.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


def dense_product(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """`quantized_matmul(x, w, ..., transpose=True)` as dequantize + matmul."""
    return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).T


def _calls(shape: Shape, weights: tuple[mx.array, ...], tokens: int, top_k: int) -> dict[str, Callable[[], mx.array]]:
    """MLX's quantized product and the dequantized one, for `tokens` tokens through `shape`."""
    e, n, k, bits, gs, dtype = shape
    q, s, b = weights
    key = mx.random.key(tokens)
    if e == 0:
        x = mx.random.normal((tokens, k), key=key).astype(dtype)
        mx.eval(x)
        return {
            "mlx": partial(mx.quantized_matmul, x, q, s, b, transpose=True, group_size=gs, bits=bits),
            "dequantized": partial(dense_product, x, q, s, b, group_size=gs, bits=bits),
        }
    top = min(top_k, e)
    idx = mx.argsort(mx.random.uniform(shape=(tokens, e), key=key), axis=-1)[:, :top].flatten()
    order = mx.argsort(idx)
    experts = idx[order]
    xs = mx.random.normal((tokens, k), key=key).astype(dtype)[order // top][:, None]
    mx.eval(experts, xs)
    return {
        "mlx": partial(
            mx.gather_qmm, xs, q, s, b, rhs_indices=experts, transpose=True, group_size=gs, bits=bits,
            sorted_indices=True,
        ),
        "dequantized": partial(
            expert_product, xs, q, s, b, experts, group_size=gs, bits=bits, sorted_indices=True
        ),
    }  # fmt: skip


def tune(shapes: Iterable[Shape], tokens: tuple[int, ...] = (2048, 512, 128), top_k: int = 8) -> dict[str, Any]:
    """Measure each shape's prefill products both ways at `tokens` tokens (routed to `top_k`
    experts each), from the largest count down, stopping at the first where MLX's op wins."""
    report: dict[str, Any] = {}
    for shape in shapes:
        e, n, k, bits, gs, dtype = shape
        if _key(shape) in _thresholds:
            continue
        entry: dict[str, Any] = {}
        report[_name(shape)] = entry
        threshold: int | None = None
        try:
            w = mx.random.normal((e, n, k) if e else (n, k), key=mx.random.key(e * 3 + n + k)).astype(dtype) * 0.02
            weights = tuple(mx.quantize(w, group_size=gs, bits=bits))
            mx.eval(weights)
            del w
            per = {}
            for t in sorted(tokens, reverse=True):
                calls = _calls(shape, weights, t, top_k)
                err = _rel_err(calls["dequantized"](), calls["mlx"]())
                if err > _TOLERANCE:
                    raise RuntimeError(f"differs from MLX's op by {err:.3g} at {t} tokens")
                times = {name: _time(call, reps=4, queue=_queue(max(e, 1) * n * k)) for name, call in calls.items()}
                per[t] = times
                if times["dequantized"] >= times["mlx"]:
                    break
                threshold = t
            entry.update(threshold=threshold, tokens=per)
        except Exception as e_:  # noqa: BLE001 - the shape keeps MLX's products
            threshold = None
            entry["failed"] = repr(e_)
            log.debug("dequantized batch prefill off for %s: %s", shape, e_)
        _thresholds[_key(shape)] = threshold
        _weight_bytes[_key(shape)] = max(e, 1) * n * k * dtype.size
    return report


def _name(shape: Shape) -> str:
    e, n, k, bits, gs, dtype = shape
    return f"{'experts ' + str(e) + 'x' if e else ''}{n}x{k} q{bits} g{gs} {dtype}"


def summary(shapes: Iterable[Shape], report: dict[str, Any]) -> str:
    """The start-up line: each shape's threshold and the times measured (dequantized/MLX's)."""
    parts = []
    for shape in shapes:
        entry = report.get(_name(shape), {})
        threshold = _thresholds.get(_key(shape))
        where = f"dequantized from {threshold} tokens" if threshold else "MLX's op"
        measured = sorted(entry.get("tokens", {}).items())
        times = ", ".join(f"{t}: {1e3 * v['dequantized']:.2f}/{1e3 * v['mlx']:.2f} ms" for t, v in measured)
        failed = f" (failed: {str(entry['failed'])[:120]})" if "failed" in entry else ""
        parts.append(f"{_name(shape).rsplit(' ', 2)[0]}: {where}" + (f" [{times}]" if times else "") + failed)
    return "batch prefill through quantized weights (model/prefill_dequant.py): " + "; ".join(parts)
