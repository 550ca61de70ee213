"""LoRA / DoRA adapters mounted on a base model, chosen per row of a batch.

`install(model)` wraps every adaptable linear (each block's Linear / QuantizedLinear, and a
top-level Linear such as `lm_head`) in an `AdaptedLinear`; base weights are never touched.
`mount(model, adapter)` registers an adapter (model/lora/load.py `load_adapter`) under an index;
`select(model, rows)` says, before a forward, which adapters each batch row uses: one tuple of
indices per row in batch order, () = the base model, (i, j) = both deltas summed. The forward's
signature does not change: the wrappers read the model's current selection.

Plain LoRA adapters are packed side by side (model/lora/pack.py): the base product runs once for
the whole batch, and every row's delta, whichever adapters (or none) it picked, is two small
products with a per-row column mask (model/lora/delta.py). A batch mixing four adapters costs what
one adapter costs; base-only forwards skip the delta. That path keeps the fused decode products
and the compiled decode (model/engine/compiled_decode.py), which takes the mask as an input
(`step_inputs`, `bound`) and re-reads the layers when `version` changes.

DoRA rescales whole outputs, so a selection naming a DoRA adapter runs in the wrappers, eager:
one adapter for the whole batch, or per group of rows that share a selection (`compilable` is
then False).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from model.lora import pack as lora_pack
from model.lora.delta import LORA_B, PACKED_KEYS, STATE_ATTR, RowMask, with_delta
from model.lora.load import (
    LINEAR_TYPES,
    Adapter,
    ModuleDelta,
    ModuleKey,
    dense_weight,
    is_wrapper,
    layers_prefix,
    load_adapter,
    named_modules,
)
from model.lora.stack import stack_problem
from model.nn.fused_projections import fusion_groups
from model.nn.language_model import LanguageModel

__all__ = [
    "AdaptedLinear",
    "Adapter",
    "LoraState",
    "bound",
    "compilable",
    "install",
    "installed",
    "load_adapter",
    "mount",
    "mounted",
    "select",
    "step_inputs",
    "uninstall",
    "unmount",
    "version",
]

Selection = tuple[int, ...]
_VERSION_ATTR = "_lora_version"
_versions = itertools.count(1)


@attrs.frozen(eq=False)
class Plan:
    """A selection prepared for the forwards. `packed`: every row on plain LoRA adapters or none
    (the mask in `LoraState.rows`); else DoRA: `uniform` when every row selects the same adapters
    (any batch size then), or per distinct selection the batch rows that use it."""

    rows: tuple[Selection, ...] = ()
    packed: bool = True
    uniform: Selection | None = ()
    groups: tuple[tuple[Selection, mx.array], ...] = ()
    version: int = 0


@attrs.define(eq=False)
class LoraState:
    """A model's mounted adapters (index -> adapter), their packing, and the current selection."""

    adapters: dict[int, Adapter] = attrs.field(factory=dict)
    next_index: int = 0
    plan: Plan = Plan()
    packing: lora_pack.Packing | None = None
    rows: RowMask | None = None  # the packed path's mask; None: no row has a delta
    # Top-level wrappers holding packed arrays (the LM head), by path: compiled stages take
    # their arrays as inputs (`step_inputs`).
    top: dict[str, AdaptedLinear] = attrs.field(factory=dict)


class AdaptedLinear(nn.Module):
    """A base Linear / QuantizedLinear plus the deltas of whichever mounted adapters the current
    selection picks for each row. The deltas live in the adapters (looked up by this module's
    key), not in this module's parameters, so the parameter tree keeps only the base weights."""

    wraps_linear = True
    per_layer_attributes = ("key",)  # differs between layers that otherwise share one structure

    def __init__(self, base: nn.Module, key: ModuleKey, state: LoraState):
        super().__init__()
        self.base = base
        object.__setattr__(self, "key", key)  # a plain attribute: nn.Module would keep a tuple as a child
        self._state = state

    def _deltas(self, selection: Selection) -> list[ModuleDelta]:
        adapters, out = self._state.adapters, []
        for i in selection:
            delta = adapters[i].modules.get(self.key)
            if delta is not None:
                out.append(delta)
        return out

    def __call__(self, x: mx.array) -> mx.array:
        state = self._state
        plan = state.plan
        if plan.packed:
            y = self.base(x)
            return y if state.rows is None else with_delta(y, x, self, "", state.rows)
        if plan.uniform is not None:
            return self._apply(x, self._deltas(plan.uniform))
        if x.shape[0] != len(plan.rows):
            raise ValueError(f"LoRA selection has {len(plan.rows)} rows, the forward {x.shape[0]}")
        y = self.base(x)
        for selection, members in plan.groups:
            deltas = self._deltas(selection)
            if not deltas:
                continue
            xs = x[members]
            if deltas[0].norm_scale is not None:  # DoRA rescales the whole output: replace the rows
                y[members] = self._dora(xs, deltas[0])
            else:  # the same expression as a uniform batch, on these rows of the shared base product
                y[members] = self._add_deltas(y[members], xs, deltas)
        return y

    def _apply(self, x: mx.array, deltas: list[ModuleDelta]) -> mx.array:
        if not deltas:
            return self.base(x)
        if deltas[0].norm_scale is not None:
            return self._dora(x, deltas[0])
        return self._add_deltas(self.base(x), x, deltas)

    @staticmethod
    def _add_deltas(y: mx.array, x: mx.array, deltas: list[ModuleDelta]) -> mx.array:
        for d in deltas:  # mlx-lm's LoRALinear: y + (scale * z).astype(x.dtype)
            z = (x @ d.lora_a) @ d.lora_b
            y = y + (d.scale * z).astype(x.dtype)
        return y

    def _dora(self, x: mx.array, d: ModuleDelta) -> mx.array:
        assert d.norm_scale is not None
        y = x @ dense_weight(self.base).T  # mlx-lm's DoRALinear: the (dequantized) weight, bias last
        z = (x @ d.lora_a) @ d.lora_b
        out = y + (d.scale * z).astype(x.dtype)
        out = d.norm_scale.astype(x.dtype) * out
        if "bias" in self.base:
            out = out + self.base.bias
        return out


def installed(model: LanguageModel) -> LoraState | None:
    state = getattr(model, STATE_ATTR, None)
    return state if isinstance(state, LoraState) else None


def install(model: LanguageModel) -> LoraState:
    """Wrap every adaptable linear of `model` in place (idempotent). Base weights stay as they are;
    fused decode products (model/nn/fused_projections.py) stay too and add the packed deltas."""
    state = installed(model)
    if state is not None:
        return state
    state = LoraState()
    prefix = layers_prefix(model) + "."
    for i, layer in enumerate(model.layers):
        wraps = [
            (name, AdaptedLinear(m, (i, name), state))
            for name, m in named_modules(layer)
            if isinstance(m, LINEAR_TYPES)
        ]
        if wraps:
            layer.update_modules(tree_unflatten(wraps))
        for owner in _fused_owners(layer):
            object.__setattr__(owner, STATE_ATTR, state)
    top = [
        (name, AdaptedLinear(m, (None, name), state))
        for name, m in named_modules(model)
        if isinstance(m, LINEAR_TYPES) and not name.startswith(prefix)
    ]
    if top:
        model.update_modules(tree_unflatten(top))
    object.__setattr__(model, STATE_ATTR, state)
    _bump(model)
    return state


def uninstall(model: LanguageModel) -> None:
    """Put the base linears back (every adapter is dropped with the wrappers)."""
    if installed(model) is None:
        return
    lora_pack.clear(model)
    for root in [*model.layers, model]:
        base = [(name, m.base) for name, m in named_modules(root) if is_wrapper(m)]
        if base:
            root.update_modules(tree_unflatten(base))
    for layer in model.layers:
        for owner in _fused_owners(layer):
            owner.__dict__.pop(STATE_ATTR, None)
    object.__delattr__(model, STATE_ATTR)
    _bump(model)


def _fused_owners(layer: nn.Module) -> list[nn.Module]:
    return [owner for owner, _, _ in fusion_groups(layer)]


def _bump(model: LanguageModel) -> None:
    """A new `version`: the wrappers or the packed arrays changed (compiled graphs are stale)."""
    object.__setattr__(model, _VERSION_ATTR, next(_versions))


def version(model: LanguageModel) -> int:
    """Changes whenever adapters are installed, mounted, unmounted or uninstalled."""
    return int(getattr(model, _VERSION_ATTR, 0))


def _repack(model: LanguageModel, state: LoraState) -> None:
    state.packing = lora_pack.pack(model, state.adapters)
    state.top = {
        name: m for name, m in named_modules(model) if isinstance(m, AdaptedLinear) and m.key[0] is None and LORA_B in m
    }
    state.plan, state.rows = Plan(version=-1), None  # (select again before a forward)
    _bump(model)


def mounted(model: LanguageModel) -> dict[int, Adapter]:
    """Index -> adapter, for the adapters mounted on `model` (a copy)."""
    state = installed(model)
    return dict(state.adapters) if state is not None else {}


def mount(model: LanguageModel, adapter: Adapter) -> int:
    """Make `adapter` selectable on `model` (installing the wrappers first if needed); returns its
    index. Indices are never reused, so those of other adapters stay valid across unmounts.
    `adapter` must have been loaded against this model (`load_adapter` checks its shapes)."""
    state = install(model)
    if any(a.id == adapter.id for a in state.adapters.values()):
        raise ValueError(f"adapter {adapter.id!r} is already mounted")
    wrapped = {m.key for _, m in named_modules(model) if is_wrapper(m)}
    missing = sorted(str(k) for k in adapter.modules if k not in wrapped)
    if missing:
        raise ValueError(f"adapter {adapter.id!r} does not fit this model: no adaptable linear at {', '.join(missing)}")
    index = state.next_index
    state.next_index += 1
    state.adapters[index] = adapter
    _repack(model, state)
    return index


def unmount(model: LanguageModel, adapter_id: str) -> int:
    """Drop the adapter `adapter_id` from `model`; returns the index it had. The model keeps no
    reference to its arrays afterwards (they are freed once the caller drops the `Adapter` too).
    The current selection must not use it: select again first."""
    state = installed(model)
    found = [i for i, a in (state.adapters.items() if state is not None else ()) if a.id == adapter_id]
    if state is None or not found:
        raise ValueError(f"adapter {adapter_id!r} is not mounted")
    index = found[0]
    if any(index in s for s in state.plan.rows):
        raise ValueError(f"adapter {adapter_id!r} is selected by the current batch: select without it first")
    del state.adapters[index]
    _repack(model, state)
    return index


def select(model: LanguageModel, rows: Sequence[Selection]) -> None:
    """Set the adapters of each batch row (batch order) for the forwards that follow.

    `rows[i]` is a tuple of mounted indices: () the base model, (a,) one adapter, (a, b) both
    deltas summed in that order. An empty `rows` (or all ()) selects the base model for any batch.
    A DoRA adapter rescales its layers' outputs, so it cannot be stacked with another
    (model/lora/stack.py, the rule the API and the registry check too)."""
    state = installed(model)
    rows = tuple(tuple(r) for r in rows)
    if state is None:
        if any(rows):
            raise ValueError("no adapters are mounted on this model")
        return
    for selection in set(rows):
        for i in selection:
            if i not in state.adapters:
                raise ValueError(f"adapter index {i} is not mounted")
        if len(set(selection)) != len(selection):
            raise ValueError(f"adapter selection {selection} names an adapter twice")
        if problem := stack_problem([state.adapters[i] for i in selection]):
            raise ValueError(problem)
    current = version(model)
    if rows == state.plan.rows and state.plan.version == current:
        return  # (decode selects every step: the same batch keeps its mask)
    distinct = list(dict.fromkeys(rows))
    if not any(state.adapters[i].is_dora for s in distinct for i in s):
        packing = state.packing
        if packing is None or not any(distinct):
            state.rows = None  # base rows only: no delta at all
        else:  # one mask row for a uniform batch (any size), else one per row
            state.rows = _row_mask(packing, distinct if len(distinct) == 1 else rows)
        state.plan = Plan(rows=rows, version=current)
        return
    state.rows = None
    if len(distinct) == 1:
        state.plan = Plan(rows=rows, packed=False, uniform=distinct[0], version=current)
        return
    groups = tuple(
        (s, mx.array([r for r, chosen in enumerate(rows) if chosen == s], dtype=mx.int32)) for s in distinct if s
    )
    state.plan = Plan(rows=rows, packed=False, uniform=None, groups=groups, version=current)


def _row_mask(packing: lora_pack.Packing, selections: Sequence[Selection]) -> RowMask:
    """Each selection's mask row and scale (model/lora/delta.py)."""
    masks, scales = [], []
    for selection in selections:
        mask = [0.0] * packing.width
        distinct_scales = {packing.scales[i] for i in selection}
        common = distinct_scales.pop() if len(distinct_scales) == 1 else None
        for i in selection:
            lo, hi = packing.columns[i]
            mask[lo:hi] = [1.0 if common is not None else packing.scales[i]] * (hi - lo)
        masks.append(mask)
        scales.append([common if common is not None else (1.0 if selection else 0.0)])
    return RowMask(mx.array(masks, dtype=packing.dtype), mx.array(scales, dtype=packing.dtype))


def compilable(model: LanguageModel) -> bool:
    """Whether the current selection can run as a compiled decode (every row packed or base)."""
    state = installed(model)
    return state is None or state.plan.packed


def step_inputs(model: LanguageModel) -> dict[str, Any]:
    """What a compiled forward takes for the current selection ({} when no row has a delta): the
    rows' mask and scales, and the packed arrays of top-level linears (the LM head), which are
    not layer inputs and so would otherwise be baked into a trace."""
    state = installed(model)
    if state is None or state.rows is None:
        return {}
    # (state.top, read at each repack: walking the model's modules here cost 17 ms a step at 32 layers)
    top = {path: _packed(w) for path, w in state.top.items()}
    return {"mask": state.rows.mask, "scale": state.rows.scale, "top": top}


@contextmanager
def bound(model: LanguageModel, inputs: dict[str, Any]) -> Iterator[None]:
    """While tracing a compiled forward: the wrappers read `inputs` (from `step_inputs`)."""
    state = installed(model)
    if state is None:
        yield
        return
    saved_rows = state.rows
    state.rows = RowMask(inputs["mask"], inputs["scale"]) if inputs else None
    saved = {path: _packed(w) for path, w in state.top.items()}
    for path, arrays in inputs.get("top", {}).items():
        for key, value in arrays.items():
            state.top[path][key] = value
    try:
        yield
    finally:
        state.rows = saved_rows
        for path, arrays in saved.items():
            for key, value in arrays.items():
                state.top[path][key] = value


def _packed(wrapper: AdaptedLinear) -> dict[str, mx.array]:
    return {k: wrapper[k] for k in PACKED_KEYS if k in wrapper}
