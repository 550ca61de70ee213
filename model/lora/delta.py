"""The low-rank delta of packed LoRA adapters, for one product: a wrapped linear's or a fused one's.

Packed adapters (model/lora/pack.py) sit side by side in one pair of arrays per product:
`A` [in, R] and `B` [R, out], adapter k owning columns [start_k, stop_k) of A and those rows of
B. A `RowMask` says which columns each batch row uses: `mask` [rows, R] is 1 on the columns of the
row's adapters (0 elsewhere; the adapter's scale instead of 1 when a row stacks adapters whose
scales differ) and `scale` [rows, 1] the row's common scale. One batch row or all of them may
share a single mask row. The delta for every row, whatever mix of adapters (or none) the batch
holds, is then two products and two element-wise ops:

    y + (scale * (((x @ A) * mask) @ B)).astype(x.dtype)

which for a row on one adapter is mlx-lm's LoRALinear expression (the other adapters' columns
add exact zeros), and for a row on none adds exactly zero. On a CUDA GPU a decode step's delta
runs as two kernels instead (model/lora/kernel.py: the same sums in float32, rounded once, and
columns no row of the batch selects are never read, so its cost follows the adapters in use,
not the adapters mounted).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.lora import kernel as lora_kernel

# Where packed arrays live: on a wrapped linear, and beside a fused product's weights (its key + these).
# A is [in, R] (`LORA_A`), or transposed, [R, in] (`LORA_AT`), where the CUDA kernels run the
# delta (model/lora/kernel.py reads each column of A contiguously).
LORA_A = "_lora_a"
LORA_AT = "_lora_at"
LORA_B = "_lora_b"
PACKED_KEYS = (LORA_A, LORA_AT, LORA_B)
# The model's adapter state, as a plain attribute of each module owning a fused product.
STATE_ATTR = "_lora_state"


@attrs.frozen(eq=False)
class RowMask:
    mask: mx.array  # [rows or 1, R]
    scale: mx.array  # [rows or 1, 1]


def a_key() -> str:
    """Under which key (so in which layout) packing stores A on this device."""
    return LORA_AT if lora_kernel.available() else LORA_A


def packed_delta(x: mx.array, a: mx.array, b: mx.array, rows: RowMask, *, transposed: bool = False) -> mx.array:
    """Every row's delta for input `x` [rows, ..., in]: the module docstring's expression, less y
    (`a` [R, in] when `transposed`)."""
    n = rows.mask.shape[0]
    if n not in (1, x.shape[0]):
        raise ValueError(f"LoRA selection has {n} rows, the forward {x.shape[0]}")
    lead = (n,) + (1,) * (x.ndim - 2)
    width = rows.mask.shape[-1]
    z = x @ (a.T if transposed else a)
    if z.shape[-1] == width:
        z = z * rows.mask.reshape(*lead, width)
    else:  # a fused product's A: its members' columns side by side, each masked alike
        z = (z.reshape(*z.shape[:-1], -1, width) * rows.mask.reshape(*lead, 1, width)).reshape(z.shape)
    return (rows.scale.reshape(*lead, 1) * (z @ b)).astype(x.dtype)


def with_delta(y: mx.array, x: mx.array, owner: nn.Module, prefix: str, rows: RowMask) -> mx.array:
    """`y` (the base product of `x`) plus every row's delta, from the packed arrays `owner` holds
    under `prefix` + the keys above; `y` as it is where it holds none."""
    b = owner.get(prefix + LORA_B)
    if b is None:
        return y
    at = owner.get(prefix + LORA_AT)
    if at is None:
        return y + packed_delta(x, owner[prefix + LORA_A], b, rows)
    if lora_kernel.usable(x, at, b) and rows.mask.shape[0] in (1, x.size // at.shape[1]):
        return lora_kernel.add_delta(y, x, at, b, rows.mask, rows.scale)
    return y + packed_delta(x, at, b, rows, transposed=True)


def fused_product(owner: nn.Module, key: str, x: mx.array, max_rows: int) -> mx.array | None:
    """`x` times the fused weights `owner[key]` (model/nn/fused_projections.py), plus the rows'
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
    rows = state.rows
    return y if rows is None else with_delta(y, x, owner, key, rows)
