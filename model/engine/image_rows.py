"""The engine's image work for a row whose prompt carries images (a vision-language family).

At open, the row gets the prompt's mrope positions and its `PromptEmbeddings`; the prefill chunks
and the join forward slices of those instead of looking the tokens up. The vision tower runs (and
`embed_with_images` splices its features into the prompt's embeddings) when the first slice that
holds or precedes an image is asked for: a prompt-cache hit that covers every image only embeds
the text after them, so a second turn with the same screenshot never re-encodes it. After the
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

from model.engine.rows import ImageInput, RowSpec

if TYPE_CHECKING:
    from model.nn.language_model import LanguageModel


class PromptEmbeddings:
    """A prompt's [1, L, hidden] embeddings with its images' features in their pad rows, built on
    first need and shared by a row's forks (one prompt)."""

    def __init__(self, model: LanguageModel, prompt: Sequence[int], images: Sequence[ImageInput]) -> None:
        self.model, self.prompt, self.images = model, list(prompt), images
        self.images_end = max(i for i, t in enumerate(prompt) if t == model.image_token_id) + 1
        self._full: mx.array | None = None
        self.encoded = 0  # times the vision tower ran (tests)

    def slice(self, start: int, end: int) -> mx.array:
        if self._full is None and start >= self.images_end:  # text only: no vision tower
            return self.model.embed_with_images(mx.array([self.prompt[start:end]]), mx.zeros((0, 1)))
        if self._full is None:
            grids = [image.grid_thw for image in self.images]
            features = self.model.encode_images(mx.array(np.concatenate([i.pixels for i in self.images])), grids)
            self._full = self.model.embed_with_images(mx.array([self.prompt]), features)
            self.encoded += 1
        return self._full[:, start:end]

    def release(self) -> None:
        """The prompt has been forwarded: free the embeddings (a later slice rebuilds them)."""
        self._full = None


@attrs.frozen(eq=False)
class ImageState:
    key: list[int]  # the prompt-cache key tokens (image runs replaced by hash-derived ids)
    embeddings: PromptEmbeddings
    positions: mx.array  # [3, 1, L] mrope positions
    delta: int  # a text position after the prompt is its index + delta


class Row(Protocol):
    """An engine row (model/engine/decoding.py), as far as its images go."""

    image: ImageState | None


def open_state(model: LanguageModel, spec: RowSpec) -> ImageState | None:
    """The row's image state (None without images). ValueError: the model has no vision tower,
    or the prompt's image-pad runs do not match the images' grids."""
    if not spec.images:
        return None
    if getattr(model, "encode_images", None) is None:
        raise ValueError("this model has no vision tower: a row with images cannot run on it")
    merge = int(model.visual.args.spatial_merge_size)
    key = key_tokens(spec.prompt, int(model.image_token_id), spec.images, merge)  # (checks the runs)
    positions, delta = model.image_positions(spec.prompt, [image.grid_thw for image in spec.images])
    return ImageState(key, PromptEmbeddings(model, spec.prompt, spec.images), positions, delta)


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
    out = {"embeddings": state.embeddings.slice(start, end), "positions": state.positions[:, :, start:end]}
    if end >= len(state.key):
        state.embeddings.release()
    return out


def decode_inputs(rows: Sequence[Row]) -> dict[str, Any]:
    """A decode step's `delta=` for these rows ({} when every row's is 0: a text-only batch)."""
    deltas = [r.image.delta if r.image is not None else 0 for r in rows]
    if not any(deltas):
        return {}
    return {"delta": deltas[0] if len(deltas) == 1 else mx.array(deltas)}
