"""The engine's image work for a row whose prompt carries images (a vision-language family).

At open, the vision tower encodes the row's images and `embed_with_images` splices the features
into the prompt's embeddings; those and the prompt's mrope positions are kept for the prefill
chunks and the join, which forward slices of them instead of looking the tokens up. After the
prompt, a row runs at cache offset + its `delta` (model/vision/mrope.py), passed to each decode.

Prompt cache: an image row's entries are keyed by its `key` tokens: the prompt with each image's
pad-token run replaced by ids derived from the image's content hash. They are negative, so no
text prompt ever matches them; the same image (same bytes, so the same grid and features) gives
the same key, and a restored prefix holds KV computed with that very image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import mlx.core as mx
import numpy as np

from model.rows import ImageInput, RowSpec

if TYPE_CHECKING:
    from model.language_model import LanguageModel


@attrs.frozen(eq=False)
class ImageState:
    key: list[int]  # the prompt-cache key tokens (image runs replaced by hash-derived ids)
    embeddings: mx.array | None  # [1, L, hidden]; None once the prompt has been forwarded
    positions: mx.array  # [3, 1, L] mrope positions
    delta: int  # a text position after the prompt is its index + delta


class Row(Protocol):
    """An engine row (model/decoding.py), as far as its images go."""

    image: ImageState | None


def open_state(model: LanguageModel, spec: RowSpec) -> ImageState | None:
    """The row's image state (None without images). ValueError: the model has no vision tower,
    or the prompt's image-pad runs do not match the images' grids."""
    if not spec.images:
        return None
    encode = getattr(model, "encode_images", None)
    if encode is None:
        raise ValueError("this model has no vision tower: a row with images cannot run on it")
    merge = int(model.visual.args.spatial_merge_size)
    image_token = int(model.image_token_id)
    grids = [image.grid_thw for image in spec.images]
    key = key_tokens(spec.prompt, image_token, spec.images, merge)
    features = encode(mx.array(np.concatenate([image.pixels for image in spec.images])), grids)
    embeddings = model.embed_with_images(mx.array([spec.prompt]), features)
    positions, delta = model.image_positions(spec.prompt, grids)
    return ImageState(key, embeddings, positions, delta)


def key_tokens(prompt: Sequence[int], image_token: int, images: Sequence[ImageInput], merge: int) -> list[int]:
    """The prompt with image i's pad run replaced by ids derived from its hash (one run per image,
    each exactly its grid's token count)."""
    key = list(prompt)
    runs = _runs(key, image_token)
    if len(runs) != len(images):
        raise ValueError(f"{len(runs)} image-pad runs in the prompt but {len(images)} images")
    for (start, end), image in zip(runs, images):
        t, h, w = image.grid_thw
        if end - start != t * h * w // (merge * merge):
            raise ValueError(f"an image-pad run of {end - start} tokens for a {t}x{h}x{w} grid")
        # (The grid too: one image resized under another max_pixels is other pixels.)
        named = hashlib.sha256(f"{image.digest}:{t}x{h}x{w}".encode()).hexdigest()
        key[start:end] = [-(1 + int(named[:15], 16))] * (end - start)
    return key


def _runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def inputs(row: Row, start: int, end: int) -> dict[str, Any]:
    """The forward's extra arguments for prompt tokens [start, end) of `row` ({} for a text row).
    The forward that reaches the prompt's end is its last: the embeddings are released."""
    state = row.image
    if state is None:
        return {}
    assert state.embeddings is not None, "an image row's prompt was forwarded twice"
    out = {"embeddings": state.embeddings[:, start:end], "positions": state.positions[:, :, start:end]}
    if end >= len(state.key):
        row.image = attrs.evolve(state, embeddings=None)  # (a new value: forks share the old one)
    return out


def decode_inputs(rows: Sequence[Row]) -> dict[str, Any]:
    """A decode step's `delta=` for these rows ({} when every row's is 0: a text-only batch)."""
    deltas = [r.image.delta if r.image is not None else 0 for r in rows]
    if not any(deltas):
        return {}
    return {"delta": deltas[0] if len(deltas) == 1 else mx.array(deltas)}
