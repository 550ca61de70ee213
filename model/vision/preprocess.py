"""Images to the patches a Qwen2/2.5-VL vision tower reads, as Hugging Face's Qwen2VLImageProcessor
(and mlx-vlm's numpy port of it) makes them: RGB, bicubic resize to a multiple of patch * merge
within [min_pixels, max_pixels], rescale to [0, 1], normalize by the checkpoint's mean/std,
duplicate along time to temporal_patch_size, then flatten each patch in merge-group order.

`load_image` does it all with a bounded footprint: the full-size image lives only until it is
resized, the arithmetic runs in place, and `decode_cost` bounds the peak from the header alone
(model/vision/header.py), so the API can bill an image before decoding it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
from PIL import Image

from model.vision.header import ImageError, ImageHeader, open_image

MAX_ASPECT_RATIO = 200
# `load_image`'s memory per pixel, measured with margin (tests/model/test_decode_cost.py checks
# the bound). While the full-size image decodes: the decoded frame (Pillow keeps 3 or 4 bands as
# 4 bytes a pixel) and its RGB copy, 8 bytes; a WebP's decoder also holds its canvas and the
# previous frame, and the frame's bytes, 16. Once resized: the RGB image, its array and the
# float32 image, about 20 bytes, with the output patches on top.
SOURCE_BYTES_PER_PIXEL = {"WEBP": 18}
SOURCE_BYTES_PER_PIXEL_DEFAULT = 9
RESIZED_BYTES_PER_PIXEL = 28


class ImageProcessor(Protocol):
    """What the API asks of a family's image preprocessing (this module's Qwen one, or Gemma 4's
    in model/vision/gemma4.py): from an image's header, its grid, pad runs and decode cost; then
    its patches."""

    def grid(self, height: int, width: int) -> tuple[int, int, int]: ...

    def runs(self, grid: tuple[int, int, int]) -> tuple[int, ...]: ...

    def cost(self, header: ImageHeader) -> DecodeCost: ...

    def load(self, data: bytes, max_source_pixels: int) -> PreparedImage: ...


@attrs.frozen
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @classmethod
    def read(cls, model_dir: Path) -> ImageProcessorConfig:
        """preprocessor_config.json's keys (`size.shortest_edge/longest_edge` or min/max_pixels)."""
        path = model_dir / "preprocessor_config.json"
        raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        return cls(**pixel_keys(raw, cls()))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        return grid_for(height, width, self)

    def runs(self, grid: tuple[int, int, int]) -> tuple[int, ...]:
        t, h, w = grid
        return (t * h * w // self.merge_size**2,)

    def cost(self, header: ImageHeader) -> DecodeCost:
        return decode_cost(header, self)

    def load(self, data: bytes, max_source_pixels: int) -> PreparedImage:
        return load_image(data, self, max_source_pixels)


@attrs.frozen
class PreparedImage:
    pixel_values: np.ndarray  # [t * h * w, C * temporal * patch * patch] float32
    grid_thw: tuple[int, int, int]

    def token_count(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) nearest the original, multiples of `factor`, area within the bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio must be below {MAX_ASPECT_RATIO}, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """The patch grid (t, h, w) `prepare_image` makes of a height x width image."""
    c = config
    rh, rw = smart_resize(height, width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels)
    return 1, rh // c.patch_size, rw // c.patch_size


@attrs.frozen
class DecodeCost:
    """What `load_image` holds in memory for one image, in bytes: at its peak, and once it has
    returned (the patches)."""

    peak: int
    output: int


def decode_cost(header: ImageHeader, config: ImageProcessorConfig) -> DecodeCost:
    """An upper bound of `load_image`'s memory for an image with this header. The full-size
    image is dropped once resized, so the peak is the larger of the two stages."""
    _, gh, gw = grid_for(header.height, header.width, config)
    resized = gh * gw * config.patch_size**2
    output = resized * 3 * config.temporal_patch_size * 4  # float32 patches
    per_pixel = SOURCE_BYTES_PER_PIXEL.get(header.format, SOURCE_BYTES_PER_PIXEL_DEFAULT)
    # (the resize's horizontal pass, then the resized image, each 4 bytes a pixel)
    source_stage = header.pixels * per_pixel + (gw * config.patch_size * header.height + resized) * 4
    resized_stage = resized * RESIZED_BYTES_PER_PIXEL + output
    return DecodeCost(peak=max(source_stage, resized_stage), output=output)


def decode_image(data: bytes, max_source_pixels: int = 64 * 1024 * 1024) -> Image.Image:
    """Encoded bytes (PNG, JPEG, WebP, GIF: the first frame) to an RGB image; anything that
    cannot be decoded is an ImageError. The opened file (and a WebP decoder's buffers) is closed
    once its RGB copy exists."""
    image = open_image(data, max_source_pixels)
    try:
        with image:
            return image.convert("RGB")
    except Exception as e:  # Pillow raises many types for corrupt data
        raise ImageError(f"cannot decode image: {e}") from None


def load_image(data: bytes, config: ImageProcessorConfig, max_source_pixels: int) -> PreparedImage:
    """`prepare_image(decode_image(data))`, the full-size image dropped once it is resized."""
    return _patches(_resized(decode_image(data, max_source_pixels), config), config)


def prepare_image(image: Image.Image, config: ImageProcessorConfig) -> PreparedImage:
    return _patches(_resized(image, config), config)


def _resized(image: Image.Image, config: ImageProcessorConfig) -> Image.Image:
    """The RGB image at its `smart_resize` size (bicubic, as the reference processor)."""
    c = config
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    width, height = rgb.size
    rh, rw = smart_resize(height, width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels)
    if (rh, rw) == (height, width):
        return rgb
    return rgb.resize((rw, rh), resample=Image.Resampling.BICUBIC)


def _patches(image: Image.Image, config: ImageProcessorConfig) -> PreparedImage:
    """Rescaled, normalized, flattened patches of a resized RGB image. The arithmetic is the
    reference's, in place, and each patch is written once into the output (time duplicated by
    broadcasting), so the peak is the float image plus the output."""
    c = config
    rgb = np.asarray(image)  # [H, W, 3] uint8
    height, width = rgb.shape[0], rgb.shape[1]
    img = np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32)
    del rgb
    img *= np.float32(c.rescale_factor)
    img -= np.array(c.image_mean, dtype=np.float32)[:, None, None]
    img /= np.array(c.image_std, dtype=np.float32)[:, None, None]
    channels = img.shape[0]
    ps, tps, ms = c.patch_size, c.temporal_patch_size, c.merge_size
    gh, gw = height // ps, width // ps
    # [C, H, W] -> [gh/ms, gw/ms, ms, ms, C, ps, ps]: merge groups in order, each patch's pixels.
    grouped = img.reshape(channels, gh // ms, ms, ps, gw // ms, ms, ps).transpose(1, 4, 2, 5, 0, 3, 6)
    out = np.empty((gh // ms, gw // ms, ms, ms, channels, tps, ps, ps), dtype=np.float32)
    out[...] = grouped[:, :, :, :, :, None]  # one frame, repeated along time
    return PreparedImage(pixel_values=out.reshape(gh * gw, channels * tps * ps * ps), grid_thw=(1, gh, gw))


def pixel_keys(raw: dict[str, Any], d: Any) -> dict[str, Any]:
    """The keys an image and a video processor config share (patching, resize bounds as
    min/max_pixels or `size.shortest_edge/longest_edge`, normalisation), `d`'s where absent."""
    size = raw.get("size") or {}
    return {
        "patch_size": int(raw.get("patch_size", d.patch_size)),
        "temporal_patch_size": int(raw.get("temporal_patch_size", d.temporal_patch_size)),
        "merge_size": int(raw.get("merge_size", d.merge_size)),
        "min_pixels": int(raw.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
        "max_pixels": int(raw.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
        "image_mean": tuple(float(x) for x in raw.get("image_mean", d.image_mean)),
        "image_std": tuple(float(x) for x in raw.get("image_std", d.image_std)),
        "rescale_factor": float(raw.get("rescale_factor", d.rescale_factor)),
    }
