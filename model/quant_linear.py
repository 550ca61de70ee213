"""Quantized linears (and tied quantized embeddings used as the LM head) that take the CUDA kernel
of model/quant_kernel.py where it applies, and MLX's `quantized_matmul` everywhere else.

`route(model)` runs once after the weights load, on a CUDA GPU only (elsewhere the model keeps
MLX's own classes and nothing changes): each `nn.QuantizedLinear` / `nn.QuantizedEmbedding`
becomes the subclass below, in place (same parameters, same isinstance), and each distinct
weight shape is measured against MLX's op at a few row counts (`quant_kernel.tune`).

What takes the kernel: 2..64 rows of an affine 4/8-bit product, except one sequence's forward of
several tokens (a solo prompt's prefill, one row's speculative verify): those keep mlx-lm's exact
ops, so a cold solo request's greedy tokens stay mlx-lm's. One row (a B=1 decode step) keeps
MLX's one-row kernel for the same reason.

Under tensor parallelism (`rows_only`, after the model is split) every quantized product keeps
MLX's op, its rows still given as one matrix: the ranks must compute the replicated LM head
alike, and each rank's load-time measurements could pick differently.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear

from model import prefill_dequant, quant_kernel, quant_tune
from model.moe import QuantizedSwitchLinear, expert_shape

log = logging.getLogger(__name__)


def _kernel_rows(x: mx.array) -> bool:
    """Whether `x`'s rows are a batch the kernel may take: not one sequence of several tokens."""
    return not (x.ndim >= 3 and x.shape[0] == 1 and x.shape[-2] > 1)


def product(x: mx.array, module: Any) -> mx.array | None:
    """`x` times a quantized module's weights by the kernel, or None where MLX's op runs."""
    if module.mode != "affine" or not _kernel_rows(x):
        return None
    w, scales, biases = module["weight"], module["scales"], module.get("biases")
    if not quant_kernel.usable(x, w, scales, biases, module.bits, module.group_size):
        return None
    return quant_kernel.qmm(x, w, scales, biases, module.bits)


def as_rows(x: mx.array) -> mx.array:
    """`x` [..., K] as one matrix of rows [R, K] for MLX's op. MLX's CUDA `quantized_matmul` takes
    every leading dimension but the last two as a batch of separate products, each reading the
    whole weight: a decode step's [B, 1, K] would read the weights B times (B products of one
    row), the [R, K] matrix reads them once. One sequence's [1, L, K] and one row's [1, 1, K] are
    the same problem either way, so a solo request's ops do not change."""
    return x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x


class RowsQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear that gives MLX's op its rows as one matrix (`as_rows`)."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(as_rows(x)).reshape(*x.shape[:-1], -1)


class KernelQuantizedLinear(RowsQuantizedLinear):
    """RowsQuantizedLinear whose product of a few rows runs the CUDA kernel, and whose batch
    prefill dequantizes the weight for one GEMM where measured faster (model/prefill_dequant.py)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self)
        if y is None and prefill_dequant.batch_prefill(x) and self.mode == "affine":
            if prefill_dequant.wins(dense_shape(self, x.dtype), x.size // x.shape[-1]):
                w, scales, biases = self["weight"], self["scales"], self.get("biases")
                y = prefill_dequant.dense_product(x, w, scales, biases, group_size=self.group_size, bits=self.bits)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


def dense_shape(module: Any, dtype: Any) -> prefill_dequant.Shape:
    """(0, N, K, bits, group size, dtype) of a quantized linear (0: not a stack of experts)."""
    n, packed = module["weight"].shape
    return (0, n, packed * 32 // module.bits, module.bits, module.group_size, dtype)


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied LM head) gives MLX's op its rows as one
    matrix (`as_rows`)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return super().as_linear(as_rows(x)).reshape(*x.shape[:-1], -1)


class KernelQuantizedEmbedding(RowsQuantizedEmbedding):
    """RowsQuantizedEmbedding whose `as_linear` runs the CUDA kernel for a few rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = product(x, self)
        return super().as_linear(x) if y is None else y


class RowsQuantizedAllToShardedLinear(QuantizedAllToShardedLinear):
    """A column-parallel quantized linear that gives MLX's op its rows as one matrix."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(as_rows(x)).reshape(*x.shape[:-1], -1)


class RowsQuantizedShardedToAllLinear(QuantizedShardedToAllLinear):
    """A row-parallel quantized linear that gives MLX's op its rows as one matrix (the partial
    products are summed across ranks as that matrix)."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(as_rows(x)).reshape(*x.shape[:-1], -1)


_ROWS_ONLY: dict[type, type] = {
    nn.QuantizedLinear: RowsQuantizedLinear,
    KernelQuantizedLinear: RowsQuantizedLinear,
    nn.QuantizedEmbedding: RowsQuantizedEmbedding,
    KernelQuantizedEmbedding: RowsQuantizedEmbedding,
    QuantizedAllToShardedLinear: RowsQuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear: RowsQuantizedShardedToAllLinear,
}


def rows_only(model: nn.Module) -> int:
    """After a tensor-parallel split, on a CUDA GPU: every quantized linear (sharded or replicated)
    keeps MLX's op, given its rows as one matrix; returns how many modules changed class (0
    elsewhere: off CUDA the model keeps MLX's own classes). The kernel is left out on purpose:
    every rank computes the replicated LM head, and all must round it the same way."""
    if not quant_kernel.available():
        return 0
    changed = 0
    for _, module in model.named_modules():
        rows_class = _ROWS_ONLY.get(type(module))
        if rows_class is not None:
            module.__class__ = rows_class
            changed += 1
    return changed


Shape = tuple[int, int, int, int, Any]  # (N, K, bits, group size, scales dtype)
ExpertShape = tuple[int, int, int, int, int, Any]  # (experts, N, K, bits, group size, scales dtype)


def route(model: nn.Module, *, tune: bool = True) -> int:
    """Route `model`'s quantized linears through the kernel on a CUDA GPU; returns how many
    modules were routed (0 elsewhere). `tune`: measure each weight shape, the routed experts'
    too (model/quant_tune.py). Logs one line: which shapes take the kernel at which row counts,
    and why the others keep MLX's op (`summary`)."""
    if not quant_kernel.available():
        log.debug("quantized products: MLX's own ops (model/quant_kernel.py's kernels need a CUDA GPU)")
        return 0
    shapes: set[Shape] = set()
    experts: set[ExpertShape] = set()
    prefill: set[prefill_dequant.Shape] = set()
    refused: dict[str, int] = {}
    routed = 0
    for path, module in model.named_modules():
        if type(module) is QuantizedSwitchLinear:
            e, n, packed = module["weight"].shape
            k = packed * 32 // module.bits
            if module.mode == "affine":  # a batch's prefill may dequantize them (model/prefill_dequant.py)
                prefill.add(expert_shape(module, module["scales"].dtype))
            why = _refusal(module) or ("expert biases" if "bias" in module else None)
            why = why or (None if quant_kernel.gather_config_for(n, k, module.bits) else "no tiling")
            if why is None:
                experts.add((e, n, k, module.bits, module.group_size, module["scales"].dtype))
            else:
                refused[f"experts {e}x{n}x{k}: {why}"] = refused.get(f"experts {e}x{n}x{k}: {why}", 0) + 1
            continue
        if type(module) is nn.QuantizedLinear:
            module.__class__ = KernelQuantizedLinear
        elif type(module) is nn.QuantizedEmbedding:
            module.__class__ = KernelQuantizedEmbedding
        else:
            continue
        routed += 1
        n, packed = module["weight"].shape
        k = packed * 32 // module.bits
        # (the LM head: a prefill chunk stops before it)
        if module.mode == "affine" and type(module) is KernelQuantizedLinear and not path.endswith("lm_head"):
            prefill.add(dense_shape(module, module["scales"].dtype))
        why = _refusal(module) or (None if quant_kernel.config_for(n, k, module.bits) else "no tiling")
        if why is None:
            shapes.add((n, k, module.bits, module.group_size, module["scales"].dtype))
        else:
            refused[f"{n}x{k}: {why}"] = refused.get(f"{n}x{k}: {why}", 0) + 1
    reports: dict[str, Any] = {}
    if tune:
        reports.update(quant_tune.tune(sorted(shapes, key=str)))
        reports.update(quant_tune.tune_gather(sorted(experts, key=str)))
    activations = _activation_dtype(model)
    line, failed = summary(sorted(shapes, key=str), sorted(experts, key=str), refused, reports, activations)
    log.log(logging.WARNING if failed else logging.INFO, "%s", line)
    if prefill and tune:
        measured = prefill_dequant.tune(sorted(prefill, key=str))
        log.info("%s", prefill_dequant.summary(sorted(prefill, key=str), measured))
    return routed + len(experts)


def _refusal(module: Any) -> str | None:
    """Why a quantized module's products never take the kernel (None: they may)."""
    if module.mode != "affine":
        return f"{module.mode} mode"
    if module.bits not in quant_kernel.BITS:
        return f"{module.bits}-bit"
    if module.group_size not in quant_kernel.GROUP_SIZES:
        return f"group size {module.group_size}"
    if module.get("biases") is None:
        return "no biases"
    if module["scales"].dtype not in quant_kernel.DTYPES:
        return f"{_dtype(module['scales'].dtype)} scales"
    return None


def _activation_dtype(model: nn.Module) -> Any:
    try:
        return model.activation_dtype()
    except Exception:  # noqa: BLE001 - a model without one: not checked
        return None


def _dtype(dtype: Any) -> str:
    return {mx.bfloat16: "bf16", mx.float16: "f16", mx.float32: "f32"}.get(dtype, str(dtype))


def _row_ranges(counts: list[int]) -> str:
    """[2, 3, 4, 9, 10] -> "2-4, 9-10"."""
    out: list[str] = []
    for r in counts:
        if out and int(out[-1].split("-")[-1]) == r - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out) or "none"


def _times(per_rows: dict[Any, Any]) -> str:
    """Each measured row count's times, ours/MLX's in microseconds ("8: 14/52us, 32: 20/70us")."""
    return ", ".join(f"{m}: {1e6 * t['ours']:.0f}/{1e6 * t['mlx']:.0f}us" for m, t in sorted(per_rows.items()))


def summary(
    shapes: list[Shape],
    experts: list[ExpertShape],
    refused: dict[str, int],
    reports: dict[str, Any],
    activations: Any = None,
) -> tuple[str, bool]:
    """The start-up line of `route`: for each weight shape, the row counts (of 2..MAX_ROWS) that
    take the kernel by the measured verdicts, with the times measured (ours/MLX's) or why it is
    off; the modules refused outright; and whether any shape's kernel failed its check."""
    parts: list[str] = []
    failed = False
    for n, k, bits, gs, dtype in shapes:
        name = f"{n}x{k} q{bits} g{gs} {_dtype(dtype)}"
        entry = reports.get(f"{n}x{k} q{bits} g{gs} {dtype}", {})
        measured = quant_kernel._verdicts.get((n, k, bits, gs, str(dtype)), [])
        rows = [r for r in range(2, quant_kernel.MAX_ROWS + 1) if quant_kernel._verdict(measured, r)]
        if "failed" in entry:
            failed = True
            parts.append(f"{name}: MLX (kernel failed: {str(entry['failed'])[:200]})")
            continue
        if activations is not None and activations != dtype:
            rows = []
            entry = {**entry, "why": f"activations are {_dtype(activations)}"}
        detail = "; ".join(x for x in (entry.get("config", ""), _times(entry.get("rows", {})), entry.get("why")) if x)
        where = f"kernel at rows {_row_ranges(rows)}" if rows else "MLX at every row count"
        parts.append(f"{name}: {where}" + (f" [{detail}]" if detail else ""))
    for e, n, k, bits, gs, dtype in experts:
        name = f"experts {e}x{n}x{k} q{bits} g{gs} {_dtype(dtype)}"
        entry = reports.get(f"{e}x{n}x{k} q{bits} g{gs} {dtype}", {})
        measured = quant_kernel._gather_verdicts.get((e, n, k, bits, gs, str(dtype)), [])
        tokens = [t for t in range(2, quant_kernel.MAX_ROWS + 1) if quant_kernel._verdict(measured, t)]
        if "failed" in entry:
            failed = True
            parts.append(f"{name}: MLX (kernel failed: {str(entry['failed'])[:200]})")
        else:
            detail = _times(entry.get("tokens", {}))
            where = f"kernel at tokens {_row_ranges(tokens)}" if tokens else "MLX at every token count"
            parts.append(f"{name}: {where}" + (f" [{detail}]" if detail else ""))
    for why, count in sorted(refused.items()):
        parts.append(f"{why}: MLX ({count} module{'s' if count > 1 else ''})")
    head = "quantized products on CUDA (model/quant_kernel.py; ours/MLX's time per product): "
    tail = "; one row (a B=1 decode step) and a solo prefill always take MLX's op"
    return head + ("; ".join(parts) or "no quantized products") + tail, failed
