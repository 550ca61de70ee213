"""Images in chat requests, for a vision-language model: each protocol's image parts, their bytes,
and the prompt's image tokens.

A translator turns each image part into an `ImagePart` (its bytes, or the 400 it earns) and puts
`PLACEHOLDER` in the message text where the image was: Qwen2-VL templates render an image part as
exactly these tokens, so any template renders the same prompt from text.

Then, before any pixel is decoded, `plan_images` reads each image's header: the model must have
vision, an image must be a PNG, JPEG, WebP or GIF within `MAX_SOURCE_PIXELS` and `MAX_FRAMES`,
and its header size gives its patch grid (the model's resize rules), its prompt tokens and what
decoding it will cost in memory. `expanded_length` is the prompt's length once each image's pad
token grows into its grid, so a prompt that cannot fit is refused undecoded, and
`request_bytes` is the request's bill (api/media.py decodes under it). `prepare_images` (a
worker thread's work) decodes the parts into the engine's `ImageInput`s, and `expand` grows the
pad tokens. Only inline (base64) data is taken: the server fetches nothing over the network.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from actors.worker_api import ModelInfo
from api.errors import ApiError, bad_request
from api.template_messages import media_error
from model.engine.rows import ImageInput
from model.vision.header import ImageError, read_header
from model.vision.preprocess import DecodeCost, decode_cost, grid_for, load_image

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_IMAGES = 8  # per request
MAX_BASE64_CHARS = 20 * 1024 * 1024  # one image's encoded data
MAX_SOURCE_PIXELS = 8192 * 8192  # before resizing (the model's own max_pixels applies after)
MAX_FRAMES = 1000  # an animated image's (only the first is read; this bounds the header walk)
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)


@attrs.frozen(eq=False)
class ImagePart:
    kind: str  # the content part's type (a text-only model's 400 names it)
    param: str  # the request field it came in ("messages", "input")
    data: bytes = b""
    error: ApiError | None = None  # why it cannot be used (raised only on a vision model)


def from_url(url: Any, kind: str, where: str, param: str) -> ImagePart:
    """An image part given as a URL: only a base64 `data:` URL is taken."""
    if not isinstance(url, str):
        return _bad(kind, param, f"{where}: the image URL must be a string")
    if url[:8].lower().startswith(("http://", "https://")):
        return _bad(
            kind,
            param,
            f"{where}: image URLs are not fetched (this server makes no network requests); "
            "send the image inline as a base64 data: URL",
        )
    match = _DATA_URL.match(url)
    if match is None:
        return _bad(kind, param, f"{where}: the image must be a data: URL (data:image/png;base64,...)")
    if "base64" not in match.group(2).lower().split(";"):
        return _bad(kind, param, f"{where}: the image data: URL must be base64 encoded (;base64,)")
    return from_base64(url[match.end() :], match.group(1), kind, where, param)


def from_base64(data: Any, media_type: Any, kind: str, where: str, param: str) -> ImagePart:
    """An image part given as base64 data and its media type."""
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        return _bad(kind, param, f"{where}: unsupported image type {media_type!r} (png, jpeg, webp or gif)")
    if not isinstance(data, str):
        return _bad(kind, param, f"{where}: the image data must be a base64 string")
    if len(data) > MAX_BASE64_CHARS:
        return _bad(kind, param, f"{where}: the image data is over {MAX_BASE64_CHARS // (1024 * 1024)} MB of base64")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return _bad(kind, param, f"{where}: the image data is not valid base64")
    return ImagePart(kind, param, raw)


def _bad(kind: str, param: str, message: str) -> ImagePart:
    return ImagePart(kind, param, error=bad_request(message, param=param, code="invalid_image"))


def check_vision(parts: Sequence[ImagePart], info: ModelInfo) -> None:
    """The 400s a request with these images earns before any decoding."""
    if not parts:
        return
    if not info.vision or info.image_processor is None:
        raise media_error(parts[0].kind)  # a text-only model: the same 400 as ever
    if len(parts) > MAX_IMAGES:
        raise bad_request(f"at most {MAX_IMAGES} images per request, got {len(parts)}", param=parts[0].param)
    for part in parts:
        if part.error is not None:
            raise part.error


@attrs.frozen
class ImagePlan:
    """One image as its header says it will be: its patch grid, prompt tokens and decode cost."""

    grid: tuple[int, int, int]
    tokens: int
    cost: DecodeCost


def plan_images(parts: Sequence[ImagePart], info: ModelInfo) -> tuple[ImagePlan, ...]:
    """Each image's plan, from its header alone (blocking, but no pixel is decoded). Raises
    ApiError: no vision, too many images, an unreadable header, too many pixels or frames."""
    check_vision(parts, info)
    config = info.image_processor
    assert config is not None  # (check_vision)
    plans = []
    for i, part in enumerate(parts):
        try:
            header = read_header(part.data, max_pixels=MAX_SOURCE_PIXELS, max_frames=MAX_FRAMES)
            grid = grid_for(header.height, header.width, config)
        except ImageError as e:
            raise _image_error(i, part, e) from None
        tokens = grid[0] * grid[1] * grid[2] // config.merge_size**2
        plans.append(ImagePlan(grid, tokens, decode_cost(header, config)))
    return tuple(plans)


def expanded_length(tokens: Sequence[int], plans: Sequence[ImagePlan], info: ModelInfo, param: str) -> int:
    """The length `expand` will give the prompt. Raises ApiError when the prompt's pad tokens are
    not exactly one per image."""
    _check_pads(tokens.count(info.image_token_id), len(plans), param)
    return len(tokens) - len(plans) + sum(plan.tokens for plan in plans)


def request_bytes(plans: Sequence[ImagePlan]) -> int:
    """The memory decoding these images takes at most: one after another, each one's peak on top
    of the patches already made."""
    if not plans:
        return 0
    return sum(p.cost.output for p in plans) + max(p.cost.peak - p.cost.output for p in plans)


def prepare_images(parts: Sequence[ImagePart], info: ModelInfo) -> tuple[ImageInput, ...]:
    """Decoded, resized, patched images (blocking: run it on a worker thread; `plan_images`
    first). Raises ApiError."""
    config = info.image_processor
    assert config is not None  # (plan_images)
    out = []
    for i, part in enumerate(parts):
        try:
            prepared = load_image(part.data, config, MAX_SOURCE_PIXELS)
        except ImageError as e:
            raise _image_error(i, part, e) from None
        digest = hashlib.sha256(part.data).hexdigest()
        out.append(ImageInput(prepared.pixel_values, prepared.grid_thw, digest))
    return tuple(out)


def _image_error(index: int, part: ImagePart, error: ImageError) -> ApiError:
    return bad_request(f"image {index + 1}: {error}", param=part.param, code="invalid_image")


def _check_pads(pads: int, images: int, param: str) -> None:
    if pads != images:
        raise bad_request(
            f"the prompt has {pads} image placeholders for {images} images "
            "(message text must not contain the model's image tokens)",
            param=param,
        )


def expand(
    tokens: Sequence[int], images: Sequence[ImageInput], info: ModelInfo, param: str
) -> tuple[list[int], Callable[[int], int]]:
    """The prompt with image i's one pad token grown to its grid's token count, and where a
    position of the unexpanded prompt moves to. A prompt whose pad tokens are not exactly one per
    image (the text itself holds the placeholder, or the template dropped a message) is a 400."""
    pads = [i for i, t in enumerate(tokens) if t == info.image_token_id]
    _check_pads(len(pads), len(images), param)
    assert info.image_processor is not None
    merge = info.image_processor.merge_size
    counts = [t * h * w // (merge * merge) for t, h, w in (image.grid_thw for image in images)]
    out: list[int] = []
    start = 0
    for at, count in zip(pads, counts):
        out += tokens[start:at]
        out += [info.image_token_id] * count
        start = at + 1
    out += tokens[start:]

    def moved(position: int) -> int:
        return position + sum(count - 1 for at, count in zip(pads, counts) if at < position)

    return out, moved
