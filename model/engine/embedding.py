"""Embeddings from a decoder: pooled final-norm hidden states (model/load/embedding_config.py's `Pooling`).

`embed` runs a batch of inputs of different lengths in one forward: right-padded, so causal
attention keeps every real position blind to the padding after it, and pooling reads real
positions only (last token, mean, or first). Fresh caches per call (nothing is shared with the
prompt cache or the decode batch); long inputs run in `chunk`-token pieces as prefill does.

An embedding checkpoint loads like its generative family with two tolerances (`checkpoint_weights`,
`headless_config`): official Qwen3-Embedding files name the backbone without the `model.` prefix,
and may ship no LM head even where config.json says the embeddings are untied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from model.kv.cache import KVCache
from model.load.embedding_config import Pooling
from model.nn.language_model import LanguageModel

PREFILL_CHUNK = 2048
_BACKBONE = "model."
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's, as sentence-transformers' Normalize uses


def checkpoint_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The checkpoint's arrays with the backbone under `model.` (flat keys get the prefix)."""
    if any(k.startswith(_BACKBONE) for k in weights) or "embed_tokens.weight" not in weights:
        return weights
    return {(k if k.startswith("lm_head.") else _BACKBONE + k): v for k, v in weights.items()}


def headless_config(raw: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """config.json as the model is built: without an lm_head in the checkpoint, the head (never
    used for embeddings) is the tied embedding, so no missing parameter fails the load."""
    if "lm_head.weight" in weights or raw.get("tie_word_embeddings") is True:
        return raw
    return {**raw, "tie_word_embeddings": True}


def embed(
    model: LanguageModel,
    token_batches: Sequence[Sequence[int]],
    pooling: Pooling,
    *,
    dimensions: int | None = None,
    chunk: int = PREFILL_CHUNK,
) -> list[list[float]]:
    """One vector per input (each a non-empty token list), in order. `dimensions`: keep the
    first that many components (re-normalized when the model normalizes)."""
    if not token_batches or any(len(t) == 0 for t in token_batches):
        raise ValueError("every input needs at least one token")
    lengths = [len(t) for t in token_batches]
    width = max(lengths)
    tokens = mx.array([list(t) + [0] * (width - len(t)) for t in token_batches], dtype=mx.int32)
    last = mx.array(lengths, dtype=mx.int32) - 1
    caches = [KVCache() for _ in model.layers]
    pooled: mx.array | None = None
    for start in range(0, width, chunk):
        end = min(width, start + chunk)
        hidden = model(tokens[:, start:end], caches).astype(mx.float32)  # [B, n, H]
        part = _pool_chunk(hidden, start, last, pooling.mode)
        pooled = part if pooled is None else pooled + part
        mx.eval(pooled, [c.state for c in caches])  # one chunk's activations at a time
    assert pooled is not None
    if pooling.mode == "mean":
        pooled = pooled / (last + 1).astype(mx.float32)[:, None]
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    if pooling.normalize:
        norms = mx.sqrt(mx.sum(pooled * pooled, axis=-1, keepdims=True))
        pooled = pooled / mx.maximum(norms, _NORM_EPS)
    vectors: list[list[float]] = pooled.tolist()  # type: ignore[assignment]
    return vectors


def _pool_chunk(hidden: mx.array, start: int, last: mx.array, mode: str) -> mx.array:
    """This chunk's share of each row's pooled vector [B, H]: its sum over the row's real
    positions (mean), or the state at the row's last / first position when it falls here."""
    B, n, _ = hidden.shape
    positions = mx.arange(start, start + n)
    if mode == "mean":
        real = positions[None, :] <= last[:, None]
        return mx.sum(mx.where(real[..., None], hidden, mx.zeros_like(hidden)), axis=1)
    target = last if mode == "lasttoken" else mx.zeros((B,), dtype=mx.int32)
    inside = (target >= start) & (target < start + n)
    index = mx.clip(target - start, 0, n - 1)
    picked = mx.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
    return mx.where(inside[:, None], picked, mx.zeros_like(picked))
