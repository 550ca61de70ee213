"""Mounted LoRA adapters packed side by side per product, so a batch mixing them costs as one does.

`pack(model, adapters)` gives each wrapped linear that a mounted plain-LoRA adapter adapts the
packed `A` [in, R] (transposed, [R, in], where model/lora/kernel.py runs) and `B` [R, out] of
model/lora/delta.py (adapter k in its own columns, zeros where it leaves a module alone). Modules
no adapter touches get none, so a block no adapter reaches costs what the base costs (the
compiled decode traces each pair of layer shapes it meets). Each fused product (q/k/v, gate/up:
model/nn/fused_projections.py) whose members are packed gets its own pair: the members' A side by
side [in, g*R] and their B block-diagonal [g*R, out_1 + ...]; one packed member packs its
partners too (zeros), since a fused product adds all its members' deltas or none.
DoRA adapters are not packed: they rescale whole outputs, so the wrappers run them per group.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.lora.delta import LORA_AT, LORA_B, PACKED_KEYS, a_key
from model.lora.load import Adapter, ModuleKey, is_wrapper, linear_dims, named_modules
from model.nn.fused_projections import fusion_groups
from model.nn.language_model import LanguageModel


@attrs.frozen(eq=False)
class Packing:
    """Where each packed adapter sits: its columns of every A (rows of every B), and its scale."""

    columns: dict[int, tuple[int, int]]
    scales: dict[int, float]
    width: int
    dtype: mx.Dtype
    nbytes: int


def clear(model: LanguageModel) -> None:
    """Remove every packed array `pack` added."""
    for _, module in model.named_modules():
        for key in [k for k in module if k.endswith(PACKED_KEYS)]:
            del module[key]


def pack(model: LanguageModel, adapters: dict[int, Adapter]) -> Packing | None:
    """Pack the plain-LoRA adapters of `adapters` (index -> adapter) onto `model`'s wrappers,
    replacing any earlier packing; None when there is none to pack."""
    clear(model)
    plain = {i: a for i, a in sorted(adapters.items()) if not a.is_dora}
    if not plain:
        return None
    columns, start = {}, 0
    for i, adapter in plain.items():
        rank = max(d.lora_a.shape[1] for d in adapter.modules.values())
        columns[i] = (start, start + rank)
        start += rank
    dtypes = {d.lora_a.dtype for a in plain.values() for d in a.modules.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else mx.float32
    adapted = _with_fusion_partners(model, {key for a in plain.values() for key in a.modules})
    transposed = a_key() == LORA_AT
    if transposed:  # whole groups of 8 columns: a fused product's members then sum in the kernels' order
        start = -(-start // 8) * 8
    created: list[mx.array] = []
    for _, wrapper in named_modules(model):
        if is_wrapper(wrapper) and wrapper.key in adapted:
            a, b = _stack(wrapper, plain, columns, start, dtype)
            wrapper[a_key()], wrapper[LORA_B] = (_transposed(a) if transposed else a), b
            created += [wrapper[a_key()], wrapper[LORA_B]]
    for layer in model.layers:
        for owner, fused_key, names in fusion_groups(layer):
            members = [owner[n] for n in names if n in owner]
            if owner.get(fused_key) is None or len(members) < len(names) or not all(LORA_B in m for m in members):
                continue
            parts = [m[a_key()] for m in members]
            owner[fused_key + a_key()] = mx.concatenate(parts, axis=0 if transposed else 1)
            owner[fused_key + LORA_B] = _block_diagonal([m[LORA_B] for m in members])
            created += [owner[fused_key + a_key()], owner[fused_key + LORA_B]]
    mx.eval(created)
    return Packing(
        columns=columns,
        scales={i: a.scale for i, a in plain.items()},
        width=start,
        dtype=dtype,
        nbytes=sum(a.nbytes for a in created),
    )


def _with_fusion_partners(model: LanguageModel, keys: set[ModuleKey]) -> set[ModuleKey]:
    """`keys` plus, in the same layer, the other members of any fused product one of them belongs
    to: a fused product adds its members' deltas only if every member has arrays."""
    out = set(keys)
    for i, layer in enumerate(model.layers):
        paths = {id(m): name for name, m in layer.named_modules()}
        for owner, _, members in fusion_groups(layer):
            group = {(i, f"{paths[id(owner)]}.{m}") for m in members}
            if group & keys:
                out |= group
    return out


def _transposed(a: mx.array) -> mx.array:
    """`a.T` as an array of its own (the kernels read it row by row)."""
    return mx.contiguous(a.T)


def _stack(
    wrapper: nn.Module, plain: dict[int, Adapter], columns: dict[int, tuple[int, int]], width: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    n_in, n_out = linear_dims(wrapper.base)
    a_parts, b_parts = [], []
    for i, adapter in plain.items():
        lo, hi = columns[i]
        delta = adapter.modules.get(wrapper.key)
        if delta is None:  # this adapter leaves the module alone: zero columns
            a_parts.append(mx.zeros((n_in, hi - lo), dtype))
            b_parts.append(mx.zeros((hi - lo, n_out), dtype))
            continue
        pad = hi - lo - delta.lora_a.shape[1]  # a module of lower rank than its adapter's widest
        a_parts.append(mx.pad(delta.lora_a.astype(dtype), [(0, 0), (0, pad)]))
        b_parts.append(mx.pad(delta.lora_b.astype(dtype), [(0, pad), (0, 0)]))
    used = max(hi for _, hi in columns.values())
    if width > used:  # (padding columns no row selects)
        a_parts.append(mx.zeros((n_in, width - used), dtype))
        b_parts.append(mx.zeros((width - used, n_out), dtype))
    a, b = mx.concatenate(a_parts, axis=1), mx.concatenate(b_parts, axis=0)
    assert a.shape == (n_in, width) and b.shape == (width, n_out)
    return a, b


def _block_diagonal(blocks: list[mx.array]) -> mx.array:
    """[R, out_j] blocks -> [g*R, sum out_j], block j at rows j*R and its own output columns."""
    widths = [b.shape[1] for b in blocks]
    total, rows, before = sum(widths), [], 0
    for block, width in zip(blocks, widths, strict=True):
        r = block.shape[0]
        parts = [mx.zeros((r, before), block.dtype), block, mx.zeros((r, total - before - width), block.dtype)]
        rows.append(mx.concatenate([p for p in parts if p.shape[1]], axis=1))
        before += width
    return mx.concatenate(rows, axis=0)
