"""A batch's prefill through quantized routed experts on CUDA: the experts dequantized, then one
grouped GEMM, where that is measured faster than MLX's `gather_qmm`.

MLX's CUDA `gather_qmm` over a prefill's (token, expert) pairs runs every pair as a product of
its own one row: a 2,048-token chunk with 8 experts a token is 16,384 one-row products per
projection, each reading its expert's weights (from L2 at best, the pairs sorted by expert).
Dequantizing the stacked experts once ([experts, N, K] in the activation dtype, a transient of
the layer's size) and `gather_mm` over the sorted pairs (on CUDA a grouped GEMM) reads each
expert once per chunk. Which wins depends on the shape and the token count, so it is measured
at load (`tune`, from `quant_linear.route`): token counts downwards from a full prefill chunk,
the smallest that still won becomes the shape's threshold; fewer tokens (decode steps) keep
`gather_qmm` (or the few-row kernel of model/quant_kernel.py).

Only a batch's prefill (several sequences) takes it: one sequence's prefill keeps mlx-lm's exact
ops, so a cold solo request's greedy tokens stay mlx-lm's (model/moe.py `_dequantized_prefill`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import mlx.core as mx

from model import quant_kernel
from model.quant_tune import _TOLERANCE, _queue, _rel_err, _time

log = logging.getLogger(__name__)

ExpertShape = tuple[int, int, int, int, int, Any]  # (experts, N, K, bits, group size, dtype)

# Per expert shape: the fewest tokens from which the dequantized path measured faster (None:
# never; a shape not measured keeps gather_qmm).
_thresholds: dict[tuple[int, int, int, int, int, str], int | None] = {}
_stack_bytes: dict[tuple[int, int, int, int, int, str], int] = {}  # a dequantized stack's size


def _key(shape: ExpertShape) -> tuple[int, int, int, int, int, str]:
    e, n, k, bits, gs, dtype = shape
    return (e, n, k, bits, gs, str(dtype))


def wins(shape: ExpertShape, tokens: int) -> bool:
    """Whether `tokens` tokens of a batch's prefill through experts of `shape` take the
    dequantized path here (a CUDA GPU, the shape measured, at least its threshold)."""
    if not quant_kernel.available():
        return False
    threshold = _thresholds.get(_key(shape))
    return threshold is not None and tokens >= threshold


def transient_bytes() -> int:
    """What a batch's prefill chunk holds at once beyond a plain one where this path is on: one
    layer's three dequantized stacks (gate, up, down), the largest measured; 0 where it is off."""
    on = [_stack_bytes[key] for key, threshold in _thresholds.items() if threshold is not None]
    return 3 * max(on, default=0)


def product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, indices: mx.array, *,
            group_size: int, bits: int, mode: str = "affine", sorted_indices: bool = False) -> mx.array:  # fmt: skip
    """`gather_qmm(x, w, ..., transpose=True)` as dequantize + `gather_mm`."""
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return mx.gather_mm(x, dense.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


def tune(shapes: Iterable[ExpertShape], tokens: tuple[int, ...] = (2048, 512, 128), top_k: int = 8) -> dict[str, Any]:
    """Measure each shape's prefill products both ways at `tokens` tokens routed to `top_k`
    experts each, from the largest count down, stopping at the first where gather_qmm wins."""
    report: dict[str, Any] = {}
    for shape in shapes:
        e, n, k, bits, gs, dtype = shape
        if _key(shape) in _thresholds:
            continue
        entry: dict[str, Any] = {}
        report[f"{e}x{n}x{k} q{bits} g{gs} {dtype}"] = entry
        threshold: int | None = None
        try:
            key = mx.random.key(e * 3 + n + k)
            q, s, b = mx.quantize(mx.random.normal((e, n, k), key=key).astype(dtype) * 0.02, group_size=gs, bits=bits)
            mx.eval(q, s, b)
            top, per = min(top_k, e), {}
            for t in sorted(tokens, reverse=True):
                idx = mx.argsort(mx.random.uniform(shape=(t, e), key=key), axis=-1)[:, :top].flatten()
                order = mx.argsort(idx)
                experts = idx[order]
                xs = mx.random.normal((t, k), key=key).astype(dtype)[order // top][:, None]
                mx.eval(experts, xs)
                calls = {
                    "mlx": partial(
                        mx.gather_qmm, xs, q, s, b, rhs_indices=experts, transpose=True, group_size=gs, bits=bits,
                        sorted_indices=True,
                    ),
                    "dequantized": partial(
                        product, xs, q, s, b, experts, group_size=gs, bits=bits, sorted_indices=True
                    ),
                }  # fmt: skip
                err = _rel_err(calls["dequantized"](), calls["mlx"]())
                if err > _TOLERANCE:
                    raise RuntimeError(f"differs from gather_qmm by {err:.3g} at {t} tokens")
                times = {name: _time(call, reps=4, queue=_queue(e * n * k)) for name, call in calls.items()}
                per[t] = times
                if times["dequantized"] >= times["mlx"]:
                    break
                threshold = t
            entry.update(threshold=threshold, tokens=per)
        except Exception as e_:  # noqa: BLE001 - the shape keeps gather_qmm
            threshold = None
            entry["failed"] = repr(e_)
            log.debug("dequantized expert prefill off for %s: %s", shape, e_)
        _thresholds[_key(shape)] = threshold
        _stack_bytes[_key(shape)] = e * n * k * dtype.size
    return report


def summary(shapes: Iterable[ExpertShape], report: dict[str, Any]) -> str:
    """The start-up line's part: each shape's threshold and the times measured (dequantized/MLX's)."""
    parts = []
    for shape in shapes:
        e, n, k, bits, gs, dtype = shape
        entry = report.get(f"{e}x{n}x{k} q{bits} g{gs} {dtype}", {})
        threshold = _thresholds.get(_key(shape))
        where = f"dequantized from {threshold} tokens" if threshold else "gather_qmm"
        times = ", ".join(
            f"{t}: {1e3 * v['dequantized']:.2f}/{1e3 * v['mlx']:.2f} ms"
            for t, v in sorted(entry.get("tokens", {}).items())
        )
        failed = f" (failed: {str(entry['failed'])[:120]})" if "failed" in entry else ""
        parts.append(f"experts {e}x{n}x{k} q{bits}: {where}" + (f" [{times}]" if times else "") + failed)
    return "batch prefill through routed experts: " + "; ".join(parts)
