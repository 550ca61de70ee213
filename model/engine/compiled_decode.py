"""A decoder's decode forward (L == 1) as compiled, fused stages: same numerics, far fewer host ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model.kv.cache import LayerCache
from model.lora import mount as lora
from model.lora.delta import PACKED_KEYS
from model.nn.decoder import DecoderLayer, DecoderModel
from model.nn.fused_projections import fuse_projections

# What a compiled stage takes per layer: {"p": its parameters, "h": its hidden arrays (fused
# weights: `_`-named, so not parameters) and "l": its packed adapter arrays, by (module path, key)}.
LayerInputs = dict[str, Any]


def _structure(layer: nn.Module) -> tuple[Any, ...]:
    """Everything about a layer that is not an array (bits, group sizes, head counts, RoPE
    settings): the traced graph bakes these in, so layers share compiled stages only when equal."""
    out = []
    for name, module in layer.named_modules():
        skip = ("_training", "_no_grad", *getattr(module, "per_layer_attributes", ()))
        plain = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if k not in skip and isinstance(v, (bool, int, float, str, type(None), tuple))
        )
        hidden = sorted(
            k
            for k, v in module.items()
            if k.startswith("_") and isinstance(v, mx.array) and not k.endswith(PACKED_KEYS)
        )
        out.append((name, type(module).__name__, tuple(plain), tuple(hidden)))
    return tuple(out)


def _layer_inputs(layer: DecoderLayer) -> LayerInputs:
    hidden: dict[tuple[str, str], mx.array] = {}
    adapters: dict[tuple[str, str], mx.array] = {}
    for name, module in layer.named_modules():
        for key, value in module.items():
            if key.startswith("_") and isinstance(value, mx.array):
                (adapters if key.endswith(PACKED_KEYS) else hidden)[(name, key)] = value
    return {"p": layer.parameters(), "h": hidden, "l": adapters}


class CompiledDecode:
    """One decode forward (L == 1) whose shape-stable stages run as compiled, fused graphs.

    A decode step is host-bound on small models: building the graph op by op in Python costs
    more than the device needs to run it. Per layer, everything except the KV-cache update and
    the attention itself has shapes that do not change from step to step (only the KV length
    grows), so it is compiled once per batch size: [embed + layer 0's projections], then per
    layer [o_proj + residual + MLP + residual + the next layer's norm, q/k/v, q/k norms, RoPE],
    then [final norm + LM head]. The cache update and scaled_dot_product_attention stay eager
    (their shapes grow every step). The ops and their order are exactly `DecoderModel.__call__`'s,
    so results are identical to the eager graph.

    One compiled function serves every layer: layer weights are inputs, not constants, and
    a template layer (layer 0, restored afterwards) is re-pointed at them while tracing. That
    needs every layer to have the same structure (same quantization, say); otherwise
    `enabled` is False and the caller uses the eager forward.

    `fuse`: fuse each layer's decode projections first (model/nn/fused_projections.py; CUDA).

    LoRA adapters (model/lora/mount.py): the rows' adapter mask (and the LM head's packed arrays) are
    inputs of every stage, and the layers' packed arrays are layer inputs like the weights, given
    only while some row has a delta (layers adapters do not reach have none: a stage is traced
    per pair of layer shapes it meets); so mounting or unmounting re-reads the layers (`ready`) but
    keeps every trace whose shapes still hold (base-only steps keep theirs). A selection only the
    eager wrappers run (DoRA) makes `ready` False.
    """

    def __init__(self, model: DecoderModel, *, fuse: bool = False) -> None:
        self.model = model
        if model.layers and fuse:
            fuse_projections(model)
        self._offset_host: int | None = None
        self._offset_dev: mx.array | None = None
        self._read_layers()
        self._first = mx.compile(self._first_fn)
        self._mid = mx.compile(self._mid_fn)
        self._last = mx.compile(self._last_fn)

    def _read_layers(self) -> None:
        """The layers' arrays as stage inputs (again after adapters change the model)."""
        layers = self.model.layers
        self.enabled = bool(layers) and len({_structure(layer) for layer in layers}) == 1
        self._version = lora.version(self.model)
        self._params = [_layer_inputs(layer) for layer in layers]
        self._base_params = [{**p, "l": {}} for p in self._params]  # (steps with no delta)
        self._packed = {where for p in self._params for where in p["l"]}
        self._template = layers[0] if layers else None
        self._modules = dict(self._template.named_modules()) if self._template is not None else {}

    def ready(self) -> bool:
        """Whether the next decode step can run compiled (the layers re-read if adapters changed)."""
        if lora.version(self.model) != self._version:
            self._read_layers()
        return self.enabled and lora.compilable(self.model)

    def _as(self, params: LayerInputs) -> DecoderLayer:
        t = self._template
        assert t is not None  # only called with layers to run
        t.update(params["p"])
        for (name, key), value in (params["h"] | params["l"]).items():
            self._modules[name][key] = value
        for name, key in self._packed - params["l"].keys():  # (layers differ in which products adapters reach)
            self._modules[name].pop(key, None)
        return t

    def _restore(self) -> None:
        self._as(self._params[0])

    def _first_fn(self, p0: LayerInputs, tokens: mx.array, offset: mx.array, rows: dict) -> tuple[mx.array, ...]:
        try:
            with lora.bound(self.model, rows):
                h = self.model.model.embed_tokens(tokens)
                return (h, *self._as(p0).project(h, offset))
        finally:
            self._restore()

    def _mid_fn(
        self, pa: LayerInputs, pb: LayerInputs, x: mx.array, attended: mx.array, offset: mx.array, rows: dict
    ) -> tuple[mx.array, ...]:
        try:
            with lora.bound(self.model, rows):
                h = self._as(pa).finish(x, attended)
                return (h, *self._as(pb).project(h, offset))
        finally:
            self._restore()

    def _last_fn(self, p: LayerInputs, x: mx.array, attended: mx.array, rows: dict) -> mx.array:
        try:
            with lora.bound(self.model, rows):
                h = self.model.model.norm(self._as(p).finish(x, attended))
                return self.model.logits(h[:, -1, :])
        finally:
            self._restore()

    def __call__(self, tokens: mx.array, caches: Sequence[LayerCache]) -> mx.array:
        """tokens [B, 1] → logits [B, vocab]; updates `caches` like `DecoderModel.__call__`."""
        mask = caches[0].make_mask(1)
        offset = caches[0].offset
        if isinstance(offset, int):
            # A solo row's position as a device scalar, advanced on the device from step to step
            # (no host-to-device upload per step); rebuilt only when the position jumps.
            host = offset
            device = self._offset_dev
            if self._offset_host != host or device is None:
                device = mx.array(host, dtype=mx.int32)
            offset = device
            self._offset_host, self._offset_dev = host + 1, device + 1
        layers, rows = self.model.layers, lora.step_inputs(self.model)
        params = self._params if rows else self._base_params
        h, q, k, v = self._first(params[0], tokens, offset, rows)
        last = len(caches) - 1
        for i, cache in enumerate(caches):
            attended = layers[i].self_attn.attend_cached(q, k, v, mask, cache)
            if i == last:
                return self._last(params[i], h, attended, rows)
            h, q, k, v = self._mid(params[i], params[i + 1], h, attended, offset, rows)
        raise AssertionError("unreachable")
