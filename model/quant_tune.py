"""Where model/quant_kernel.py's kernels win, measured on this GPU for each weight shape a model
holds (model/quant_linear.py `route` runs this once after loading, before any decode is traced).

For each shape: the kernel's output is checked against MLX's op (a tiling that fails or
disagrees is never used), then both are timed at a few row counts (calls queued, `_time`); a row
count takes the verdict of the nearest measured one at or above it. Row counts are measured
upwards and the first where MLX's op wins ends the shape's measurement: that count and every
larger one keep MLX's op. MLX's GEMM gains on the kernel as rows grow (H100: of 11 weight shapes
measured at 2-64 rows over three loads, none won again after a loss), and every larger row bucket
is another kernel NVRTC builds at the machine's first load (~3 s each: an 8B q4 load spent ~35 s
building kernels that then lost; model/kernels/cuda_build.py keeps the builds on disk). What was decided is logged by
`route` in one line. With `search`, every tiling is timed at 32 rows first
and the fastest becomes the shape's (one tiling per shape: a row's k order never depends on its
batch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import mlx.core as mx

from model import quant_kernel as qk

log = logging.getLogger(__name__)

# The largest relative difference from MLX's own op a kernel may show in the check (bf16 rounding
# of 4/8-bit products is ~1e-2 of the largest output at worst).
_TOLERANCE = 3e-2


def _time(fn: Callable[[], mx.array], reps: int = 20, queue: int = 20) -> float:
    """Seconds per call of `fn` on the device, calls queued `queue` at a time and evaluated
    together (as a compiled decode step runs its products back to back). One synchronized call
    at a time would time the launch and the host round trip (tens of microseconds) more than a
    product of a few megabytes, and leave the verdict of small shapes to noise. `queue` bounds
    the memory of what MLX's op materializes per call (its dequantized weights)."""
    mx.eval(fn())
    mx.synchronize()
    total, done = 0.0, 0
    while done < reps:
        outs = [fn() for _ in range(min(queue, reps - done))]
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        total += time.perf_counter() - start
        done += len(outs)
        del outs
    return total / reps


def _queue(weights: int) -> int:
    """How many calls to queue for a product of `weights` values: about 4 GB of bf16 copies."""
    return max(2, min(20, int(4e9 // (2 * weights))))


# A decode step reads each weight once, from device memory; one weight timed over and over would
# sit in the GPU's L2 (50 MB on an H100) and time the cache instead. Calls rotate over copies
# holding at least this many bytes in all.
_ROTATE_BYTES = 256 << 20


def _copies(*arrays: mx.array) -> list[tuple[mx.array, ...]]:
    """Copies of a weight's arrays, enough that timing one call after another over them reads
    device memory rather than L2 (`_ROTATE_BYTES`)."""
    size = sum(a.nbytes for a in arrays)
    count = max(1, min(32, -(-_ROTATE_BYTES // max(size, 1))))
    out = [arrays] + [tuple(a + 0 for a in arrays) for _ in range(count - 1)]
    mx.eval(out)
    return out


def _rotating(
    fn: Callable[..., mx.array], copies: list[tuple[mx.array, ...]], *head: Any, **kw: Any
) -> Callable[[], mx.array]:
    """`fn(*head, *copy, **kw)` over the copies in turn, one per call."""
    turn = [0]

    def call() -> mx.array:
        turn[0] = (turn[0] + 1) % len(copies)
        return fn(*head, *copies[turn[0]], **kw)

    return call


def _rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err: float = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()  # type: ignore[assignment]
    return err


def _ours(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, bits: int, cfg: qk.Config) -> mx.array:
    return qk.qmm(x, w, scales, biases, bits, cfg)


def tune(
    shapes: Iterable[tuple[int, int, int, int, mx.Dtype]],
    rows: tuple[int, ...] = (2, 8, 16, 32, 64),
    *,
    search: bool = False,
) -> dict[str, Any]:
    """Measure each dense (N, K, bits, group size, dtype); returns what was measured (seconds)."""
    report: dict[str, Any] = {}
    for n, k, bits, gs, dtype in shapes:
        key_ = (n, k, bits, gs, str(dtype))
        if key_ in qk._verdicts and not search:
            continue
        cands = qk._candidates(n, k, bits)
        if not cands:
            continue
        entry: dict[str, Any] = {}
        report[f"{n}x{k} q{bits} g{gs} {dtype}"] = entry
        try:
            key = mx.random.key(n * 7 + k)
            w = mx.random.normal((n, k), key=key).astype(dtype) * 0.02
            q, s, b = mx.quantize(w, group_size=gs, bits=bits)
            mx.eval(q, s, b)
            if search:
                x = mx.random.normal((32, k), key=key).astype(dtype)
                want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)
                times = {}
                for cfg in cands:
                    try:
                        if _rel_err(qk.qmm(x, q, s, b, bits, cfg), want) <= _TOLERANCE:
                            times[cfg] = _time(partial(qk.qmm, x, q, s, b, bits, cfg), queue=_queue(n * k))
                        else:
                            entry[f"wrong {cfg}"] = True
                    except Exception as e:  # noqa: BLE001 - a tiling this GPU refuses is just not used
                        entry[f"failed {cfg}"] = repr(e)
                if times:
                    qk._tuned[(n, k, bits)] = min(times, key=lambda c: times[c])
                    entry["tilings_32_rows"] = {str(c): t for c, t in times.items()}
            chosen = qk.config_for(n, k, bits)
            assert chosen is not None
            x8 = mx.random.normal((8, k), key=key).astype(dtype)
            want8 = mx.quantized_matmul(x8, q, s, b, group_size=gs, bits=bits)
            err = _rel_err(qk.qmm(x8, q, s, b, bits, chosen), want8)
            if err > _TOLERANCE:
                raise RuntimeError(f"{chosen} differs from MLX's op by {err:.3g}")
            measured, per_rows = [], {}
            copies = _copies(q, s, b)
            for m in sorted(rows):
                x = mx.random.normal((m, k), key=key).astype(dtype)
                ours = _time(_rotating(_ours, copies, x, bits=bits, cfg=chosen), queue=_queue(n * k))
                mlx_op = _rotating(mx.quantized_matmul, copies, x, transpose=True, group_size=gs, bits=bits)
                theirs = _time(mlx_op, queue=_queue(n * k))
                measured.append((m, ours < theirs))
                per_rows[m] = {"ours": ours, "mlx": theirs}
                if ours >= theirs:
                    break  # (larger counts: MLX's op, unmeasured; see the module docstring)
            qk._verdicts[key_] = measured
            entry.update(config=str(chosen), kernel_rows=[m for m, f in measured if f], rows=per_rows)
        except Exception as e:  # noqa: BLE001 - the shape keeps MLX's op
            qk._verdicts[key_] = [(max(rows), False)]
            entry["failed"] = repr(e)
            log.debug("quantized kernel off for %s: %s", key_, e)  # (route's line says so)
    return report


def tune_gather(
    shapes: Iterable[tuple[int, int, int, int, int, mx.Dtype]],
    tokens: tuple[int, ...] = (2, 8, 32, 64),
    top_k: int = 8,
) -> dict[str, Any]:
    """Measure each routed-experts (experts, N, K, bits, group size, dtype) against
    `gather_qmm(sorted_indices=True)` for `tokens` tokens routed to `top_k` experts each."""
    report: dict[str, Any] = {}
    for e, n, k, bits, gs, dtype in shapes:
        key_ = (e, n, k, bits, gs, str(dtype))
        if key_ in qk._gather_verdicts or qk.gather_config_for(n, k, bits) is None:
            continue
        entry: dict[str, Any] = {}
        report[f"{e}x{n}x{k} q{bits} g{gs} {dtype}"] = entry
        try:
            key = mx.random.key(e + n + k)
            w = mx.random.normal((e, n, k), key=key).astype(dtype) * 0.02
            q, s, b = mx.quantize(w, group_size=gs, bits=bits)
            mx.eval(q, s, b)
            del w
            top = min(top_k, e)
            measured, per = [], {}
            for t in sorted(tokens):
                x = mx.random.normal((t, k), key=key).astype(dtype)
                idx = mx.argsort(mx.random.uniform(shape=(t, e), key=key), axis=-1)[:, :top].flatten()
                order = mx.argsort(idx)
                experts, rowmap = idx[order], order // top
                xs = x[rowmap][:, None]
                mx.eval(experts, rowmap, xs)
                ours_fn = partial(qk.gather_qmm, x, q, s, b, rowmap, experts, bits, rows_per_expert=min(t, 16))
                theirs_fn = partial(
                    mx.gather_qmm, xs, q, s, b, rhs_indices=experts, transpose=True, group_size=gs, bits=bits,
                    sorted_indices=True,
                )  # fmt: skip
                err = _rel_err(ours_fn(), theirs_fn().squeeze(1))
                if err > _TOLERANCE:
                    raise RuntimeError(f"differs from gather_qmm by {err:.3g} at {t} tokens")
                ours, theirs = _time(ours_fn, queue=_queue(e * n * k)), _time(theirs_fn, queue=_queue(e * n * k))
                measured.append((t, ours < theirs))
                per[t] = {"ours": ours, "mlx": theirs}
                if ours >= theirs:
                    break  # (larger counts: MLX's op, unmeasured; see the module docstring)
            qk._gather_verdicts[key_] = measured
            entry.update(kernel_tokens=[t for t, f in measured if f], tokens=per)
        except Exception as e_:  # noqa: BLE001 - the shape keeps MLX's gather_qmm
            qk._gather_verdicts[key_] = [(max(tokens), False)]
            entry["failed"] = repr(e_)
            log.debug("routed-experts kernel off for %s: %s", key_, e_)  # (route's line says so)
    return report
