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
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model import quant_kernel, quant_tune
from model.moe import QuantizedSwitchLinear

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


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product of a few rows runs the CUDA kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self)
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (a tied LM head) runs the CUDA kernel for a few rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = product(x, self)
        return super().as_linear(x) if y is None else y


def route(model: nn.Module, *, tune: bool = True) -> int:
    """Route `model`'s quantized linears through the kernel on a CUDA GPU; returns how many
    modules were routed (0 elsewhere). `tune`: measure each weight shape, the routed experts'
    too (model/quant_tune.py)."""
    if not quant_kernel.available():
        return 0
    shapes: set[tuple[int, int, int, int, Any]] = set()
    experts: set[tuple[int, int, int, int, int, Any]] = set()
    routed = 0
    for _, module in model.named_modules():
        if type(module) is QuantizedSwitchLinear and module.mode == "affine" and module.get("biases") is not None:
            e, n, packed = module["weight"].shape
            experts.add((e, n, packed * 32 // module.bits, module.bits, module.group_size, module["scales"].dtype))
            continue
        if type(module) is nn.QuantizedLinear:
            module.__class__ = KernelQuantizedLinear
        elif type(module) is nn.QuantizedEmbedding:
            module.__class__ = KernelQuantizedEmbedding
        else:
            continue
        routed += 1
        if module.mode == "affine" and module.bits in quant_kernel.BITS and module.get("biases") is not None:
            n, packed = module["weight"].shape
            shapes.add((n, packed * 32 // module.bits, module.bits, module.group_size, module["scales"].dtype))
    if tune:
        for name, report in (
            ("linear", quant_tune.tune(sorted(shapes, key=str))),
            ("experts", quant_tune.tune_gather(sorted(experts, key=str))),
        ):
            for shape, entry in report.items():
                where = entry.get("kernel_rows", entry.get("kernel_tokens"))
                log.info("quantized %s kernel %s: %s, kernel at %s rows", name, shape, entry.get("config", ""), where)
    return routed + len(experts)
