"""LoRA / DoRA adapters mounted on a base model, chosen per row of a batch.

`install(model)` wraps every adaptable linear (each block's Linear / QuantizedLinear, and a
top-level Linear such as `lm_head`) in an `AdaptedLinear`; base weights are never touched.
`mount(model, adapter)` registers an adapter (model/lora_load.py `load_adapter`) under an index;
`select(model, rows)` says, before a forward, which adapters each batch row uses: one tuple of
indices per row in batch order, () = the base model, (i, j) = both deltas summed. The forward's
signature does not change: the wrappers read the model's current selection.

Per linear: the base product runs once for the whole batch. When every row selects the same
adapters (a solo row, or a uniform batch) the delta is mlx-lm's own expression, so B = 1 greedy
tokens equal `mlx_lm` with that adapter; a base-only selection is exactly the base op. A mixed
batch gathers each group of rows that share a selection, computes its low-rank delta and adds it
back into those rows only.

Compiled decode (model/compiled_decode.py) would bake the selection seen while tracing into its
graph, and runs every layer through layer 0's modules: it must not run on an installed model.
(`CompiledDecode` built after `install` already finds the layers unlike and disables itself; one
built before it holds the unwrapped parameter tree and must be dropped.)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from model.decoder import FUSED_GATE_UP, FUSED_QKV
from model.language_model import LanguageModel
from model.lora_load import (
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

__all__ = [
    "AdaptedLinear",
    "Adapter",
    "LoraState",
    "install",
    "installed",
    "load_adapter",
    "mount",
    "mounted",
    "select",
    "uninstall",
    "unmount",
]

Selection = tuple[int, ...]
_STATE_ATTR = "_lora_state"


@attrs.frozen(eq=False)
class Plan:
    """A selection prepared for the forwards: `uniform` when every row selects the same adapters
    (any batch size then), else per distinct selection the batch rows that use it."""

    rows: tuple[Selection, ...] = ()
    uniform: Selection | None = ()
    groups: tuple[tuple[Selection, mx.array], ...] = ()
    # Every row on one plain LoRA adapter or none: `order` = the adapters by slot (slot 0 = none),
    # `slots` = each row's slot; the deltas then run as two gathered matmuls for the whole batch.
    order: tuple[int, ...] = ()
    slots: mx.array | None = None


@attrs.define(eq=False)
class LoraState:
    """A model's mounted adapters (index -> adapter) and its current selection."""

    adapters: dict[int, Adapter] = attrs.field(factory=dict)
    next_index: int = 0
    plan: Plan = Plan()


class AdaptedLinear(nn.Module):
    """A base Linear / QuantizedLinear plus the deltas of whichever mounted adapters the current
    selection picks for each row. The deltas live in the adapters (looked up by this module's
    key), not in this module's parameters, so the parameter tree keeps only the base weights."""

    wraps_linear = True

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
        plan = self._state.plan
        if plan.uniform is not None:
            return self._apply(x, self._deltas(plan.uniform))
        if x.shape[0] != len(plan.rows):
            raise ValueError(f"LoRA selection has {len(plan.rows)} rows, the forward {x.shape[0]}")
        y = self.base(x)
        if plan.slots is not None:
            stacked = self._stacked(plan.order)
            if stacked is None:  # no selected adapter touches this module
                return y
            a, b, scales = stacked
            if x.dtype == mx.float32:  # (MLX's GatherMM takes float32 only, for now)
                z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=plan.slots), b, rhs_indices=plan.slots)
            else:  # each row's A and B gathered (small: rank columns), then batched products
                z = (x @ a[plan.slots]) @ b[plan.slots]
            return y + (scales[plan.slots][:, None, None] * z).astype(x.dtype)
        for selection, rows in plan.groups:
            deltas = self._deltas(selection)
            if not deltas:
                continue
            xs = x[rows]
            if deltas[0].norm_scale is not None:  # DoRA rescales the whole output: replace the rows
                y[rows] = self._dora(xs, deltas[0])
            else:  # the same expression as a uniform batch, on these rows of the shared base product
                y[rows] = self._add_deltas(y[rows], xs, deltas)
        return y

    def _stacked(self, order: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array] | None:
        """These adapters' A and B stacked by slot (slot 0 and adapters that leave this module
        alone: zeros; ranks padded with zero columns), and their scales: kept per `order`."""
        cache = self.__dict__.setdefault("_stacks", {})
        if order not in cache:
            deltas = [self._state.adapters[i].modules.get(self.key) for i in order]
            found = [d for d in deltas if d is not None]
            if not found:
                cache.clear()
                cache[order] = None
                return None
            rank = max(d.lora_a.shape[1] for d in found)
            n_in, n_out = found[0].lora_a.shape[0], found[0].lora_b.shape[1]
            dtype = found[0].lora_a.dtype
            a = [mx.zeros((n_in, rank), dtype)]
            b = [mx.zeros((rank, n_out), dtype)]
            scales = [0.0]
            for d in deltas:
                if d is None:
                    a.append(a[0])
                    b.append(b[0])
                    scales.append(0.0)
                    continue
                r = d.lora_a.shape[1]
                a.append(mx.pad(d.lora_a, [(0, 0), (0, rank - r)]))
                b.append(mx.pad(d.lora_b, [(0, rank - r), (0, 0)]))
                scales.append(d.scale)
            cache.clear()  # one batch composition at a time is what decode reuses
            cache[order] = (mx.stack(a), mx.stack(b), mx.array(scales))
        return cache[order]

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
    state = getattr(model, _STATE_ATTR, None)
    return state if isinstance(state, LoraState) else None


def install(model: LanguageModel) -> LoraState:
    """Wrap every adaptable linear of `model` in place (idempotent). Base weights stay as they are.

    Fused decode projections (model/fused_projections.py) would bypass the wrappers, so they are
    dropped: the per-projection weights are views of them and stay valid."""
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
        for owner in layer.modules():
            for key in (FUSED_QKV, FUSED_GATE_UP):
                if owner.get(key) is not None:
                    del owner[key]
    top = [
        (name, AdaptedLinear(m, (None, name), state))
        for name, m in named_modules(model)
        if isinstance(m, LINEAR_TYPES) and not name.startswith(prefix)
    ]
    if top:
        model.update_modules(tree_unflatten(top))
    object.__setattr__(model, _STATE_ATTR, state)
    return state


def uninstall(model: LanguageModel) -> None:
    """Put the base linears back (every adapter is dropped with the wrappers)."""
    if installed(model) is None:
        return
    for root in [*model.layers, model]:
        base = [(name, m.base) for name, m in named_modules(root) if is_wrapper(m)]
        if base:
            root.update_modules(tree_unflatten(base))
    object.__delattr__(model, _STATE_ATTR)


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
    return index


def select(model: LanguageModel, rows: Sequence[Selection]) -> None:
    """Set the adapters of each batch row (batch order) for the forwards that follow.

    `rows[i]` is a tuple of mounted indices: () the base model, (a,) one adapter, (a, b) both
    deltas summed in that order. An empty `rows` (or all ()) selects the base model for any batch.
    A DoRA adapter rescales its layers' outputs, so it cannot be stacked with another."""
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
        if len(selection) > 1 and any(state.adapters[i].is_dora for i in selection):
            raise ValueError(f"adapter selection {selection}: a DoRA adapter cannot be stacked with another")
    distinct = list(dict.fromkeys(rows))
    if len(distinct) <= 1:
        state.plan = Plan(rows=rows, uniform=distinct[0] if distinct else ())
        return
    if all(len(s) <= 1 for s in distinct) and not any(state.adapters[s[0]].is_dora for s in distinct if s):
        order = tuple(sorted({s[0] for s in distinct if s}))
        slot = {i: n + 1 for n, i in enumerate(order)}
        slots = mx.array([slot[r[0]] if r else 0 for r in rows], dtype=mx.uint32)
    else:
        order, slots = (), None
    groups = tuple(
        (s, mx.array([r for r, chosen in enumerate(rows) if chosen == s], dtype=mx.int32)) for s in distinct if s
    )
    state.plan = Plan(rows=rows, uniform=None, groups=groups, order=order, slots=slots)
