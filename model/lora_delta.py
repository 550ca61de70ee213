"""The low-rank delta of packed LoRA adapters, for one product: a wrapped linear's or a fused one's.

Packed adapters (model/lora_pack.py) sit side by side in one pair of arrays per product:
`A` [in, R] and `B` [R, out], adapter k owning columns [start_k, stop_k) of A and those rows of
B. A `RowMask` says which columns each batch row uses: `mask` [rows, R] is 1 on the columns of the
row's adapters (0 elsewhere; the adapter's scale instead of 1 when a row stacks adapters whose
scales differ) and `scale` [rows, 1] the row's common scale. One batch row or all of them may
share a single mask row. The delta for every row, whatever mix of adapters (or none) the batch
holds, is then two products and two element-wise ops:

    y + (scale * (((x @ A) * mask) @ B)).astype(x.dtype)

which for a row on one adapter is mlx-lm's LoRALinear expression (the other adapters' columns
add exact zeros), and for a row on none adds exactly zero.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model import lora_kernel

# Where packed arrays live: on a wrapped linear, and beside a fused product's weights (its key + these).
LORA_A = "_lora_a"
LORA_B = "_lora_b"
# The model's adapter state, as a plain attribute of each module owning a fused product.
STATE_ATTR = "_lora_state"


@attrs.frozen(eq=False)
class RowMask:
    mask: mx.array  # [rows or 1, R]
    scale: mx.array  # [rows or 1, 1]


def packed_delta(x: mx.array, a: mx.array, b: mx.array, rows: RowMask) -> mx.array:
    """Every row's delta for input `x` [rows, ..., in]: the module docstring's expression, less y."""
    n = rows.mask.shape[0]
    if n not in (1, x.shape[0]):
        raise ValueError(f"LoRA selection has {n} rows, the forward {x.shape[0]}")
    lead = (n,) + (1,) * (x.ndim - 2)
    width = rows.mask.shape[-1]
    z = _times_a(x, a)
    if z.shape[-1] == width:
        z = z * rows.mask.reshape(*lead, width)
    else:  # a fused product's A: its members' columns side by side, each masked alike
        z = (z.reshape(*z.shape[:-1], -1, width) * rows.mask.reshape(*lead, 1, width)).reshape(z.shape)
    return (rows.scale.reshape(*lead, 1) * (z @ b)).astype(x.dtype)


def with_delta(y: mx.array, x: mx.array, a: mx.array, b: mx.array, rows: RowMask) -> mx.array:
    """`y` (the base product of `x`) plus every row's delta."""
    if XA == "fused" and lora_kernel.usable(x, a) and rows.mask.shape[0] in (1, x.size // a.shape[0]):
        return lora_kernel.add_delta(y, x, a, b, rows.mask, rows.scale)
    return y + packed_delta(x, a, b, rows)


# Bench-only A/B switch (benchmarks/lora_bench.py --xa), until a GPU run picks the winner: how a
# decode step's x @ A (few rows, long K, few columns: little parallelism) runs: "matmul", "split16"
# (16 partial products over slices of K, then summed), "kernel" (model/lora_kernel.py, CUDA) or
# "fused" (that kernel, then one more adding each row's masked, scaled delta times B to y).
XA = "matmul"
SPLIT_MAX_ROWS = 8


def _times_a(x: mx.array, a: mx.array) -> mx.array:
    if XA in ("kernel", "fused") and lora_kernel.usable(x, a):
        return lora_kernel.times_a(x, a)
    k = a.shape[0]
    split = 16 if XA == "split16" else 0
    if not split or k % split or x.size // k > SPLIT_MAX_ROWS:
        return x @ a
    parts = x.reshape(-1, split, k // split).transpose(1, 0, 2) @ a.reshape(split, k // split, -1)
    return parts.sum(axis=0).reshape(*x.shape[:-1], -1)


def fused_product(owner: nn.Module, key: str, x: mx.array, max_rows: int) -> mx.array | None:
    """`x` times the fused weights `owner[key]` (model/fused_projections.py), plus the rows'
    adapter deltas; None where the caller must use the separate products instead: not fused,
    more than `max_rows` rows, or adapters in a mode only the per-linear wrappers run (DoRA)."""
    fused = owner.get(key)
    if fused is None or x.size // x.shape[-1] > max_rows:
        return None
    state: Any = owner.__dict__.get(STATE_ATTR)
    if state is None:
        return x @ fused.T
    if not state.plan.packed:
        return None
    y = x @ fused.T
    a, rows = owner.get(key + LORA_A), state.rows
    if a is None or rows is None:
        return y
    return with_delta(y, x, a, owner[key + LORA_B], rows)
