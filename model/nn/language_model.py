"""What the engine and the loader need of a model: the interface every family's model class meets.

A family (model/families/) builds an instance of a `LanguageModel` subclass: the shared decoder
(model/nn/decoder.py) for Llama / Qwen, or a class of its own with its own blocks. Parameter names
follow the checkpoint, so `load_weights` fills it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.kv.cache import KVCache, LayerCache, SoloCache

# `after_layer(index, hidden)`: called by a forward after each of its blocks.
AfterLayer = Callable[[int, mx.array], None]


@attrs.frozen
class Capabilities:
    """What a family's model can take part in, declared by its class (the engine and the
    tensor-parallel code read it; they never recognise a family by its class)."""

    compiled_decode: bool = False  # decode steps as compiled stages (model/engine/compiled_decode.py)
    fused_projections: bool = False  # q/k/v and gate/up fused for decode on CUDA (model/nn/fused_projections.py)
    sharding: bool = False  # split across tensor-parallel ranks (model/nn/tensor_parallel.py)
    speculation: bool = True  # drafts verified and taken back (its caches can be trimmed)


class LanguageModel(nn.Module):
    """`hidden = model(tokens, caches)`; `logits = model.logits(hidden)`.

    The LM head is separate so callers project only the positions they sample from (a prefill
    chunk never materializes an [L, vocab] transient). `caches` holds one KV cache per layer.
    `capabilities` says what the family's model can take part in (none of the optional paths by
    default: a family's own blocks serve through the plain forward).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
    ) -> mx.array:
        """[B, L] tokens -> [B, L, hidden], updating `caches`. `unfused_attention`: a prefill's
        causal attention as matmuls (model/kernels/unfused_attention.py), no fused kernel.
        `after_layer(index, hidden)` runs after each block; it may evaluate the hidden state and
        raise to stop the forward (model/engine/prefill_abort.py). A model without blocks to stop
        between may ignore it."""
        raise NotImplementedError

    def logits(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    @property
    def layers(self) -> Sequence[nn.Module]:
        """The blocks, one KV cache each."""
        raise NotImplementedError

    @property
    def attention_heads(self) -> int:
        """Query heads per layer: sizes a prefill's attention scores."""
        raise NotImplementedError

    def make_caches(self) -> list[SoloCache]:
        """Fresh caches for one row, one per layer (a family with sliding layers overrides it)."""
        return [KVCache() for _ in self.layers]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        raise NotImplementedError

    def activation_dtype(self) -> mx.Dtype:
        """The dtype of activations, and so of the KV entries (quantized weights keep float norms)."""
        raise NotImplementedError

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint's arrays as this model names them (drops what it does not use)."""
        return weights
