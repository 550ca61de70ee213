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

# Where packed arrays live: on a wrapped linear, and beside a fused product's weights (its key + these).
LORA_A = "_lora_a"
LORA_B = "_lora_b"
# A base weight with its packed A rows appended (WIDEN): one product gives y and x @ A together.
LORA_WIDE = "_lora_wide"
# The model's adapter state, as a plain attribute of each module owning a fused product.
STATE_ATTR = "_lora_state"


@attrs.frozen(eq=False)
class RowMask:
    mask: mx.array  # [rows or 1, R]
    scale: mx.array  # [rows or 1, 1]


# Bench-only A/B switches (benchmarks/lora_bench.py --variant), until a GPU run picks the winner:
# ADDMM: the row's scale folded into its mask and y + delta as one addmm; TRANSPOSED: packed A
# stored [R, in] and B [out, R] (a Linear weight's layout), multiplied through `.T`; WIDEN
# (TRANSPOSED layout): each dense base weight gets its packed A rows appended (model/lora_pack.py).
ADDMM = False
TRANSPOSED = False
WIDEN = False


def add_packed_delta(y: mx.array, x: mx.array, a: mx.array, b: mx.array, rows: RowMask) -> mx.array:
    """`y` plus every row's delta for input `x` [rows, ..., in] (the module docstring's expression)."""
    _check(rows, x)
    return _finish(y, x @ (a.T if TRANSPOSED else a), b, rows)


def add_widened_delta(yz: mx.array, n: int, b: mx.array, rows: RowMask) -> mx.array:
    """From `yz` = x @ [W; A].T (a widened weight, its first `n` rows W): y plus the rows' deltas."""
    _check(rows, yz)
    return _finish(yz[..., :n], yz[..., n:], b, rows)


def _check(rows: RowMask, x: mx.array) -> None:
    n = rows.mask.shape[0]
    if n not in (1, x.shape[0]):
        raise ValueError(f"LoRA selection has {n} rows, the forward {x.shape[0]}")


def _finish(y: mx.array, z: mx.array, b: mx.array, rows: RowMask) -> mx.array:
    """y + the masked z (= x @ A) through B."""
    lead = (rows.mask.shape[0],) + (1,) * (z.ndim - 2)
    width = rows.mask.shape[-1]
    if z.shape[-1] == width:
        z = z * rows.mask.reshape(*lead, width)
    else:  # a fused product's A: its members' columns side by side, each masked alike
        z = (z.reshape(*z.shape[:-1], -1, width) * rows.mask.reshape(*lead, 1, width)).reshape(z.shape)
    b = b.T if TRANSPOSED else b
    if ADDMM and z.dtype == y.dtype:
        return mx.addmm(y, z, b)
    return y + (rows.scale.reshape(*lead, 1) * (z @ b)).astype(y.dtype)


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
    if not state.packed_mode:
        return None
    a, rows = owner.get(key + LORA_A), state.rows
    if a is None or rows is None:
        return x @ fused.T
    wide = owner.get(key + LORA_WIDE)
    if wide is not None:
        return add_widened_delta(x @ wide.T, fused.shape[0], owner[key + LORA_B], rows)
    return add_packed_delta(x @ fused.T, x, a, owner[key + LORA_B], rows)
