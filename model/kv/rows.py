"""A KV scheme applied to the engine's rows: when a row's caches turn quantized, which restored
prefixes can stand in for a cold prefill, and what a batch's caches are made of.

A row turns quantized after the forward that leaves its caches holding `convert_at` positions
(`KVScheme.conversion_point`; the engine ends prefill chunks there). The values a quantized
cache holds depend on where that happened, so a prompt-cache entry serves a row only when it
holds what the row's own cold run would: a full-precision entry no longer than the row's
`convert_at`, or a quantized one that turned at the same position and covers it. Anything else
is a miss, never a different result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from model.kv.cache import BatchKVCache, KVCache
from model.kv.mixed import MixedBatchKVCache
from model.kv.paged import PagedBatchKVCache
from model.kv.quant import QuantizedKVCache
from model.kv.rotating import RotatingKVCache
from model.kv.scheme import KVScheme
from model.kv.state import BatchStateCache, StateCache

if TYPE_CHECKING:
    from model.engine.decoding import Row

Solo = KVCache | QuantizedKVCache


def convert_at(scheme: KVScheme, prompt_length: int, chunk: int) -> int | None:
    """Where a row of this prompt turns quantized; None without quantization."""
    return scheme.conversion_point(prompt_length, chunk) if scheme.quantized else None


def resumable(scheme: KVScheme, fresh: Sequence[Any]) -> bool:
    """Whether a row of a model whose caches are `fresh` (its own kinds) can leave the batch and
    come back from the prompt cache exactly where it was: every layer plain KV, cut back to any
    position (a sliding window or a recurrent state cannot be), and nothing turning quantized (a
    resumed row would turn at another position)."""
    return not scheme.quantized and all(type(c) is KVCache for c in fresh)


def restorable(scheme: KVScheme, caches: Sequence[Any], cached: int, at: int | None) -> bool:
    """Whether restored `caches` (covering `cached` tokens) equal a cold run's at that point."""
    turned = set()
    for i, c in enumerate(caches):
        quant = scheme.layer(i)
        if isinstance(c, RotatingKVCache | StateCache):
            continue  # sliding layers and recurrent states stay full precision: they depend on the tokens only
        if isinstance(c, QuantizedKVCache):
            if quant is None or c.quant != quant or c.converted_at != at or at is None or cached < at:
                return False
            turned.add(True)
        elif isinstance(c, KVCache):
            if quant is not None:
                if at is None or cached > at:
                    return False
                turned.add(False)
        else:
            return False
    return len(turned) <= 1  # every quantized layer turns at once


def quantize_due(scheme: KVScheme, caches: list[Any], length: int, at: int | None) -> bool:
    """Turn a row's solo caches quantized (in place) once they hold `at` positions; True if they
    are quantized now."""
    if at is None:
        return False
    if any(isinstance(c, QuantizedKVCache) for c in caches):
        return True
    if length < at:
        return False
    for i, c in enumerate(caches):
        quant = scheme.layer(i)
        if quant is not None and isinstance(c, KVCache) and not isinstance(c, RotatingKVCache):
            caches[i] = QuantizedKVCache.from_full(c, quant)
    return True


def merge_batch(scheme: KVScheme, per_row: Sequence[Sequence[Solo]]) -> list[Any]:
    """The batch caches (one per layer) of rows given as their solo caches."""
    merged: list[Any] = []
    for layer in range(len(per_row[0])):
        caches = [row[layer] for row in per_row]
        quant = scheme.layer(layer)
        if scheme.paged and quant is None and all(type(c) is KVCache for c in caches):
            # --paged-kv: a full-attention layer that never turns quantized keeps its rows in
            # blocks (model/kv/paged.py); sliding windows, states and quantized layers do not.
            merged.append(PagedBatchKVCache.merge(cast(list[KVCache], caches)))
            continue
        # Each kind says how its rows batch (a new kind brings its own `batched`).
        mixed = MixedBatchKVCache.merge if scheme.quantized else None
        merged.append(type(caches[0]).batched(caches, quant, mixed))
    return merged


def quantize_due_rows(scheme: KVScheme, rows: Sequence[Row], caches: list[Any]) -> None:
    """Batch rows whose KV reached their conversion point turn quantized before the next
    forward, as a solo row's caches do after the forward that got them there."""
    due = [
        i for i, r in enumerate(rows) if not r.quantized and r.convert_at is not None and r.kv_length >= r.convert_at
    ]
    if not due:
        return
    for i in due:
        rows[i].quantized = True
    if is_merged(caches):
        for c in caches:
            if isinstance(c, MixedBatchKVCache):
                c.quantize_rows(due)
    else:
        quantize_due(scheme, caches, rows[0].kv_length, rows[0].convert_at)


def is_merged(caches: Sequence[Any]) -> bool:
    return bool(caches) and isinstance(
        caches[0], BatchKVCache | MixedBatchKVCache | BatchStateCache | PagedBatchKVCache
    )
