"""What the engine and the loader need of a model: the interface every family's model class meets.

A family (model/families/) builds an instance of a `LanguageModel` subclass: the shared decoder
(model/decoder.py) for Llama / Qwen, or a class of its own with its own blocks. Parameter names
follow the checkpoint, so `load_weights` fills it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from model.kv_cache import KVCache, LayerCache

# `after_layer(index, hidden)`: called by a forward after each of its blocks.
AfterLayer = Callable[[int, mx.array], None]


class LanguageModel(nn.Module):
    """`hidden = model(tokens, caches)`; `logits = model.logits(hidden)`.

    The LM head is separate so callers project only the positions they sample from (a prefill
    chunk never materializes an [L, vocab] transient). `caches` holds one KV cache per layer.
    """

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
        raise to stop the forward (model/prefill_abort.py). A model without blocks to stop
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

    def make_caches(self) -> list[LayerCache]:
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
