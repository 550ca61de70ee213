"""Images to the patches a Qwen2/2.5-VL vision tower reads, as Hugging Face's Qwen2VLImageProcessor
(and mlx-vlm's numpy port of it) makes them: RGB, bicubic resize to a multiple of patch * merge
within [min_pixels, max_pixels], rescale to [0, 1], normalize by the checkpoint's mean/std,
duplicate along time to temporal_patch_size, then flatten each patch in merge-group order.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from PIL import Image

MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image that cannot be decoded or sized (the API answers 400)."""


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
        size = raw.get("size") or {}
        d = cls()
        return cls(
            patch_size=int(raw.get("patch_size", d.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", d.merge_size)),
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
            image_mean=tuple(float(x) for x in raw.get("image_mean", d.image_mean)),
            image_std=tuple(float(x) for x in raw.get("image_std", d.image_std)),
            rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
        )


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


def decode_image(data: bytes, max_source_pixels: int = 64 * 1024 * 1024) -> Image.Image:
    """Encoded bytes (PNG, JPEG, ...) to an RGB image; anything undecodable is an ImageError."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_source_pixels:
            raise ImageError(f"image is {image.width}x{image.height}: over {max_source_pixels} pixels")
        return image.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types for corrupt or unknown data
        raise ImageError(f"cannot decode image: {e}") from None


def prepare_image(image: Image.Image, config: ImageProcessorConfig) -> PreparedImage:
    c = config
    rgb = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
    height, width = rgb.shape[0], rgb.shape[1]
    rh, rw = smart_resize(height, width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels)
    if (rh, rw) != (height, width):
        rgb = np.asarray(Image.fromarray(rgb).resize((rw, rh), resample=Image.Resampling.BICUBIC))
    img = rgb.transpose(2, 0, 1).astype(np.float32) * np.float32(c.rescale_factor)
    mean = np.array(c.image_mean, dtype=np.float32)[:, None, None]
    std = np.array(c.image_std, dtype=np.float32)[:, None, None]
    img = (img - mean) / std
    channels = img.shape[0]
    ps, tps, ms = c.patch_size, c.temporal_patch_size, c.merge_size
    gh, gw = rh // ps, rw // ps
    patches = np.repeat(img[None, None], tps, axis=1)  # one frame, repeated along time
    patches = patches.reshape(1, 1, tps, channels, gh // ms, ms, ps, gw // ms, ms, ps)
    patches = patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(gh * gw, channels * tps * ps * ps)
    return PreparedImage(pixel_values=np.ascontiguousarray(flat), grid_thw=(1, gh, gw))
