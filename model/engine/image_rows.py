"""The engine's media work for a row whose prompt carries images, videos or audio clips.

At open, the row gets its `PromptEmbeddings` and, for a multimodal-RoPE family (Qwen2.5-VL,
Qwen3.5), the prompt's positions; the prefill chunks and the join forward slices of those instead
of looking the tokens up. The towers run (and `embed_with_images` splices their features into the
prompt's embeddings) when the first slice that holds or precedes a media item is asked for: a
prompt-cache hit that covers every item only embeds the text after them, so a second turn with the
same screenshot, video or recording never re-encodes it. After the prompt, a row runs at cache
offset + its `delta` (model/vision/mrope.py), passed to each decode.

A model that takes media (duck-typed, as the engine reads it): `media_kinds` (the kinds it takes),
`media_token_ids()` (each kind's pad token), `encode_media(items)` (every item's features, one row
per pad token, in order), `embed_with_images(tokens, features)`; optionally `image_positions(prompt,
grids)` (multimodal RoPE: one (t, h, w) grid per pad run) and `atomic_media` (kinds whose runs
attend bidirectionally, so a prefill chunk never cuts one: Gemma 4's images).

Prompt cache: a media row's entries are keyed by its `key` tokens: the prompt with each item's pad
runs replaced by ids derived from the item's content hash. They are negative, so no text prompt
ever matches them; the same bytes (so the same grid and features) give the same key, and a
restored prefix holds KV computed with that very item.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import mlx.core as mx

from model.engine.rows import ImageInput, RowSpec

if TYPE_CHECKING:
    from model.nn.language_model import LanguageModel


class PromptEmbeddings:
    """A prompt's [1, L, hidden] embeddings with its media features in their pad rows, built on
    first need and shared by a row's forks (one prompt)."""

    def __init__(self, model: LanguageModel, prompt: Sequence[int], items: Sequence[ImageInput], end: int) -> None:
        self.model, self.prompt, self.images = model, list(prompt), items
        self.images_end = end  # one past the last pad token
        self._full: mx.array | None = None
        self.encoded = 0  # times the towers ran (tests)

    def slice(self, start: int, end: int) -> mx.array:
        model: Any = self.model
        if self._full is None and start >= self.images_end:  # text only: no tower
            return model.embed_with_images(mx.array([self.prompt[start:end]]), mx.zeros((0, 1)))
        if self._full is None:
            features = model.encode_media(self.images)
            self._full = model.embed_with_images(mx.array([self.prompt]), features)
            self.encoded += 1
        return self._full[:, start:end]

    def release(self) -> None:
        """The prompt has been forwarded: free the embeddings (a later slice rebuilds them)."""
        self._full = None


@attrs.frozen(eq=False)
class ImageState:
    key: list[int]  # the prompt-cache key tokens (media runs replaced by hash-derived ids)
    embeddings: PromptEmbeddings
    positions: mx.array | None  # [3, 1, L] multimodal RoPE positions (None: the family has none)
    delta: int  # a text position after the prompt is its index + delta
    blocks: tuple[tuple[int, int], ...] = ()  # [start, end) runs a prefill chunk must not cut


class Row(Protocol):
    """An engine row (model/engine/decoding.py), as far as its media go."""

    image: ImageState | None


def open_state(model: LanguageModel, spec: RowSpec) -> ImageState | None:
    """The row's media state (None without media). ValueError: the model takes no such media, or
    the prompt's pad runs do not match the items'."""
    if not spec.images:
        return None
    m: Any = model
    kinds: frozenset[str] = getattr(model, "media_kinds", frozenset())
    for item in spec.images:
        if item.kind not in kinds:
            what = "vision tower" if item.kind == "image" else f"{item.kind} input"
            raise ValueError(f"this model has no {what}: a row with {item.kind} cannot run on it")
    runs = [run_lengths(model, item) for item in spec.images]
    spans = _check_runs(spec.prompt, m.media_token_ids(), spec.images, runs)
    key = key_tokens(spec.prompt, spans, spec.images)
    positions, delta = None, 0
    if hasattr(model, "image_positions"):
        grids = [g for item, r in zip(spec.images, runs) for g in _run_grids(item, len(r))]
        positions, delta = m.image_positions(spec.prompt, grids)
    atomic: frozenset[str] = getattr(model, "atomic_media", frozenset())
    blocks = tuple(s for item, item_spans in zip(spec.images, spans) if item.kind in atomic for s in item_spans)
    embeddings = PromptEmbeddings(
        model, spec.prompt, spec.images, max(e for item_spans in spans for _, e in item_spans)
    )
    return ImageState(key, embeddings, positions, delta, blocks)


def run_lengths(model: LanguageModel, item: ImageInput) -> tuple[int, ...]:
    """The item's pad runs: as it states them, else one of its grid's tokens (Qwen's merge rule)."""
    if item.runs:
        return item.runs
    t, h, w = item.grid_thw
    visual: Any = model.visual
    merge = int(visual.args.spatial_merge_size)
    return (t * h * w // (merge * merge),)


def _run_grids(item: ImageInput, runs: int) -> list[tuple[int, int, int]]:
    """One grid per pad run: a video's temporal patches are runs of (1, h, w) (Qwen3-VL's rule)."""
    t, h, w = item.grid_thw
    return [item.grid_thw] if runs == 1 else [(1, h, w)] * runs


def _check_runs(
    prompt: Sequence[int], token_ids: dict[str, int], items: Sequence[ImageInput], runs: Sequence[tuple[int, ...]]
) -> list[list[tuple[int, int]]]:
    """Each item's [start, end) pad runs in the prompt, in order: the prompt's runs of each kind's
    pad token are exactly the items' runs."""
    pads = {token_ids[kind] for kind in {item.kind for item in items}}
    found = _runs(prompt, pads)
    wanted = sum(len(r) for r in runs)
    if len(found) != wanted:
        raise ValueError(f"{len(found)} image-pad runs in the prompt but {wanted} for {len(items)} images")
    spans: list[list[tuple[int, int]]] = []
    at = 0
    for item, lengths in zip(items, runs):
        spans.append([])
        for length in lengths:
            start, end = found[at]
            at += 1
            if prompt[start] != token_ids[item.kind] or end - start != length:
                t, h, w = item.grid_thw
                raise ValueError(f"an image-pad run of {end - start} tokens for a {t}x{h}x{w} {item.kind} grid")
            spans[-1].append((start, end))
    return spans


def key_tokens(
    prompt: Sequence[int], spans: Sequence[Sequence[tuple[int, int]]], items: Sequence[ImageInput]
) -> list[int]:
    """The prompt with each item's pad runs replaced by ids derived from its hash and grid (the
    run's index too: a video's frames differ)."""
    key = list(prompt)
    for item_spans, item in zip(spans, items):
        t, h, w = item.grid_thw
        for i, (start, end) in enumerate(item_spans):
            # (The grid too: one image resized under another max_pixels is other pixels.)
            named = hashlib.sha256(f"{item.kind}:{item.digest}:{t}x{h}x{w}:{i}".encode()).hexdigest()
            key[start:end] = [-(1 + int(named[:15], 16))] * (end - start)
    return key


def _runs(tokens: Sequence[int], pads: set[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of pad tokens (a run is one token id repeated)."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t not in pads:
            continue
        if runs and runs[-1][1] == i and tokens[i - 1] == t:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def chunk_end(row: Row, start: int, end: int) -> int:
    """Where a prefill chunk from `start` that would end at `end` ends: before a block it would
    cut (when it starts before it), else past it (a block forwards whole). (The engine may still
    end a chunk where a row's KV turns quantized, `--kv-quant`, even inside a block.)"""
    state = row.image
    if state is None:
        return end
    for block_start, block_end in state.blocks:
        if block_start < end < block_end:
            return block_start if block_start > start else block_end
    return end


def inputs(row: Row, start: int, end: int) -> dict[str, Any]:
    """The forward's extra arguments for prompt tokens [start, end) of `row` ({} for a text row).
    The forward that reaches the prompt's end is its last: the embeddings are released."""
    state = row.image
    if state is None:
        return {}
    out: dict[str, Any] = {"embeddings": state.embeddings.slice(start, end)}
    if state.positions is not None:
        out["positions"] = state.positions[:, :, start:end]
    if end >= len(state.key):
        state.embeddings.release()
    return out


def decode_inputs(rows: Sequence[Row]) -> dict[str, Any]:
    """A decode step's `delta=` for these rows ({} when every row's is 0: a text-only batch)."""
    deltas = [r.image.delta if r.image is not None else 0 for r in rows]
    if not any(deltas):
        return {}
    return {"delta": deltas[0] if len(deltas) == 1 else mx.array(deltas)}
