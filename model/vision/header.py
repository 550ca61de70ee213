"""What an encoded image is, read from its header alone: format, size, mode, frame count.

`Image.open` reads only the header, so an image's size is known before a byte of it is decoded:
the API refuses an image whose pixels, frames or tokens are over its bounds at that point, and
bills what decoding it will take (model/vision/preprocess.py `decode_cost`). Only the four
formats the API documents open; anything else (BMP, TIFF, PSD, ...) is refused here even when
Pillow could read it. Pillow's own decompression-bomb guard (`Image.MAX_IMAGE_PIXELS`) fires
inside `Image.open`, as an error or, below twice its limit, a warning that a warnings filter may
turn into an error; either way it is the same refusal as our own bound, which is lower.

An animated image is read as its first frame (as Hugging Face's processor reads one). PNG
(APNG) and WebP headers state their frame count; a GIF's frames are counted by walking its
blocks without decoding them, stopping past the limit, so the walk is bounded too.
"""

from __future__ import annotations

import io

import attrs
from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_GIF_EXTENSION, _GIF_IMAGE = 0x21, 0x2C


class ImageError(ValueError):
    """An image that cannot be decoded, sized or accepted (the API answers 400)."""


@attrs.frozen
class ImageHeader:
    format: str  # one of FORMATS ("MPO", a multi-picture JPEG, reads as JPEG)
    width: int
    height: int
    mode: str  # Pillow's mode before conversion to RGB
    frames: int  # 1 for a still image; counted up to one past the limit for a GIF

    @property
    def pixels(self) -> int:
        return self.width * self.height


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """`data` opened (its header read, nothing decoded) in one of FORMATS, at most `max_pixels`
    pixels. Raises ImageError."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image is over {max_pixels} pixels") from None
    except Image.UnidentifiedImageError:
        raise ImageError("cannot decode image: not a PNG, JPEG, WebP or GIF image") from None
    except Exception as e:  # Pillow raises many types for a corrupt header
        raise ImageError(f"cannot decode image: {e}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageError(f"image is {width}x{height}: over {max_pixels} pixels")
    return image


def read_header(data: bytes, *, max_pixels: int, max_frames: int) -> ImageHeader:
    """The header of `data`, within `max_pixels` and `max_frames`. Raises ImageError."""
    with open_image(data, max_pixels) as image:
        fmt = "JPEG" if image.format == "MPO" else str(image.format)
        if fmt == "GIF":
            frames = gif_frames(data, max_frames + 1)
        else:
            frames = int(getattr(image, "n_frames", 1))
        header = ImageHeader(fmt, image.width, image.height, image.mode, frames)
    if header.frames > max_frames:
        raise ImageError(f"image has more than {max_frames} frames (only the first would be read)")
    return header


def gif_frames(data: bytes, stop_at: int) -> int:
    """The frames of GIF `data` (its image descriptors), counted up to `stop_at`. A malformed
    block structure ends the count there: the decoder judges the data."""
    if len(data) < 13:
        return 0
    pos = 13 + _color_table(data[10])
    frames = 0
    while pos < len(data) and frames < stop_at:
        kind = data[pos]
        if kind == _GIF_EXTENSION:
            pos = _skip_sub_blocks(data, pos + 2)
        elif kind == _GIF_IMAGE:
            frames += 1
            if pos + 10 > len(data):
                break
            pos = _skip_sub_blocks(data, pos + 10 + _color_table(data[pos + 9]) + 1)  # +1: LZW code size
        else:  # the trailer, or data that is not a block
            break
    return frames


def _color_table(flags: int) -> int:
    """The bytes of the color table a GIF screen or image descriptor's packed flags announce."""
    return 3 * (2 << (flags & 7)) if flags & 0x80 else 0


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """The position after the data sub-blocks starting at `pos` (each a length byte and that many
    bytes, ended by a zero length)."""
    while pos < len(data):
        size = data[pos]
        pos += size + 1
        if size == 0:
            break
    return pos
