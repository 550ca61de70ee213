"""Mounted LoRA adapters packed side by side per product, so a batch mixing them costs as one does.

`pack(model, adapters)` gives each wrapped linear that a mounted plain-LoRA adapter adapts the
packed `A` [in, R] and `B` [R, out] of model/lora_delta.py (adapter k in its own columns, zeros
where it leaves a module alone). A module path adapted in any layer gets the arrays in every
layer, so all layers keep one structure (the compiled decode runs every layer through one graph).
Each fused product (q/k/v, gate/up: model/fused_projections.py) whose members are packed gets its
own pair: the members' A side by side [in, g*R] and their B block-diagonal [g*R, out_1 + ...].
DoRA adapters are not packed: they rescale whole outputs, so the wrappers run them per group.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import mlx.nn as nn

from model import lora_delta
from model.fused_projections import fusion_groups
from model.language_model import LanguageModel
from model.lora_delta import LORA_A, LORA_B, LORA_WIDE
from model.lora_load import Adapter, ModuleKey, is_wrapper, linear_dims, named_modules


@attrs.frozen(eq=False)
class Packing:
    """Where each packed adapter sits: its columns of every A (rows of every B), and its scale."""

    columns: dict[int, tuple[int, int]]
    scales: dict[int, float]
    width: int
    dtype: mx.Dtype
    nbytes: int


def clear(model: LanguageModel) -> None:
    """Remove every packed array `pack` added; widened base weights become their own rows again."""
    for layer in [*model.layers, model]:
        for owner, key, names in fusion_groups(layer):
            if key + LORA_WIDE in owner:
                _repoint(owner, key, names, mx.contiguous(owner[key]))  # (a copy: the wide rows go)
                del owner[key + LORA_WIDE]
        for _, wrapper in named_modules(layer):
            if is_wrapper(wrapper) and LORA_WIDE in wrapper:
                wrapper.base.weight = mx.contiguous(wrapper.base.weight)
                del wrapper[LORA_WIDE]
        mx.eval(layer.parameters())
    for _, module in model.named_modules():
        for key in [k for k in module if k.endswith((LORA_A, LORA_B))]:
            del module[key]


def _repoint(owner: nn.Module, key: str, names: tuple[str, ...], fused: mx.array) -> None:
    """Make `fused` the group's fused weight and its members' weights row views of it."""
    owner[key], start = fused, 0
    for name in names:
        base = owner[name].base if is_wrapper(owner[name]) else owner[name]
        rows = base.weight.shape[0]
        base.weight = fused[start : start + rows]
        start += rows


def _widen(model: LanguageModel) -> None:
    """Append the packed A rows to each dense base weight (fused groups: to the fused weight), so
    one product gives y and x @ A; the base weights become row views of the wider arrays (their
    narrow originals are freed, layer by layer: the extra memory is the A rows, already billed)."""
    for layer in [*model.layers, model]:
        widened: list[mx.array] = []
        fused_members: set[int] = set()
        for owner, key, names in fusion_groups(layer):
            fused, a = owner.get(key), owner.get(key + LORA_A)
            if fused is None or a is None or fused.dtype != a.dtype:
                continue
            wide = mx.concatenate([fused, a], axis=0)
            _repoint(owner, key, names, wide[: fused.shape[0]])
            owner[key + LORA_WIDE], owner[key + LORA_A] = wide, wide[fused.shape[0] :]
            fused_members.update(id(owner[n]) for n in names)
            widened.append(wide)
        for _, wrapper in named_modules(layer):
            if not is_wrapper(wrapper) or (wrapper.key[0] is None) != (layer is model):
                continue  # (the model's own pass: only its top-level linears)
            if id(wrapper) in fused_members or LORA_A not in wrapper or LORA_WIDE in wrapper:
                continue
            base = wrapper.base
            if type(base) is not nn.Linear or base.weight.dtype != wrapper[LORA_A].dtype:
                continue
            wide = mx.concatenate([base.weight, wrapper[LORA_A]], axis=0)
            n = base.weight.shape[0]
            base.weight, wrapper[LORA_WIDE], wrapper[LORA_A] = wide[:n], wide, wide[n:]
            widened.append(wide)
        mx.eval(widened)


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
    in_layers = {key[1] for a in plain.values() for key in a.modules if key[0] is not None}
    created: list[mx.array] = []
    for _, wrapper in named_modules(model):
        if not is_wrapper(wrapper):
            continue
        key: ModuleKey = wrapper.key
        adapted = key[1] in in_layers if key[0] is not None else any(key in a.modules for a in plain.values())
        if adapted:
            wrapper[LORA_A], wrapper[LORA_B] = _stack(wrapper, plain, columns, start, dtype)
            created += [wrapper[LORA_A], wrapper[LORA_B]]
    for layer in model.layers:
        for owner, fused_key, names in fusion_groups(layer):
            members = [owner[n] for n in names if n in owner]
            if owner.get(fused_key) is None or len(members) < len(names) or not all(LORA_A in m for m in members):
                continue
            if lora_delta.TRANSPOSED:
                owner[fused_key + LORA_A] = mx.concatenate([m[LORA_A] for m in members], axis=0)
                owner[fused_key + LORA_B] = mx.contiguous(_block_diagonal([m[LORA_B].T for m in members]).T)
            else:
                owner[fused_key + LORA_A] = mx.concatenate([m[LORA_A] for m in members], axis=1)
                owner[fused_key + LORA_B] = _block_diagonal([m[LORA_B] for m in members])
            created += [owner[fused_key + LORA_A], owner[fused_key + LORA_B]]
    mx.eval(created)
    if lora_delta.WIDEN:
        assert lora_delta.TRANSPOSED, "widening appends A as rows: the Linear layout"
        _widen(model)
    return Packing(
        columns=columns,
        scales={i: a.scale for i, a in plain.items()},
        width=start,
        dtype=dtype,
        nbytes=sum(a.nbytes for a in created),
    )


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
    a, b = mx.concatenate(a_parts, axis=1), mx.concatenate(b_parts, axis=0)
    assert a.shape == (n_in, width) and b.shape == (width, n_out)
    if lora_delta.TRANSPOSED:
        return mx.contiguous(a.T), mx.contiguous(b.T)
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
