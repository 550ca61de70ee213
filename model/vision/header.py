"""What an encoded image is, read from its header alone: format, size, mode, frame count.

`Image.open` reads only the header, so an image's size is known before a byte of it is decoded:
the API refuses an image whose pixels, frames or tokens are over its bounds at that point, and
bills what decoding it will take (model/vision/preprocess.py `decode_cost`). Only the four
formats the API documents open; anything else (BMP, TIFF, PSD, ...) is refused here even when
Pillow could read it. Pillow's own decompression-bomb guard (`Image.MAX_IMAGE_PIXELS`) fires
inside `Image.open`, as an error or, below twice its limit, a warning that a warnings filter may
turn into an error; either way it is the same refusal as our own bound, which is lower.

A WebP's header is read from its RIFF chunks here: Pillow's `Image.open` of a WebP reads the
whole file and sets up a decoder for its canvas. An animated image is read as its first frame
(as Hugging Face's processor reads one); an APNG states its frame count, and a WebP's or GIF's
frames are counted by walking its chunks or blocks without decoding them, stopping past the
limit, so the walk is bounded too.
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
    header = webp_header(data, max_frames + 1)
    if header is not None:
        if header.pixels > max_pixels:
            raise ImageError(f"image is {header.width}x{header.height}: over {max_pixels} pixels")
    else:
        with open_image(data, max_pixels) as image:
            fmt = "JPEG" if image.format == "MPO" else str(image.format)
            frames = gif_frames(data, max_frames + 1) if fmt == "GIF" else int(getattr(image, "n_frames", 1))
            header = ImageHeader(fmt, image.width, image.height, image.mode, frames)
    if header.frames > max_frames:
        raise ImageError(f"image has more than {max_frames} frames (only the first would be read)")
    return header


def webp_header(data: bytes, stop_at: int) -> ImageHeader | None:
    """A WebP's header from its RIFF chunks (frames counted up to `stop_at`), or None when `data`
    is not a WebP this can read (Pillow then judges it). Pillow's `Image.open` of a WebP reads the
    whole file and sets up a decoder for its canvas; this reads tens of bytes."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    kind, body = data[12:16], data[20:30]
    if kind == b"VP8X":  # extended: the canvas, and flags for alpha and animation
        width, height = 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
        frames = _webp_frames(data, stop_at) if body[0] & 0x02 else 1
        return ImageHeader("WEBP", width, height, "RGBA" if body[0] & 0x10 else "RGB", frames)
    if kind == b"VP8L" and body[0] == 0x2F:  # lossless: 14-bit sizes less one, then the alpha hint
        bits = int.from_bytes(body[1:5], "little")
        mode = "RGBA" if bits >> 28 & 1 else "RGB"
        return ImageHeader("WEBP", 1 + (bits & 0x3FFF), 1 + (bits >> 14 & 0x3FFF), mode, 1)
    if kind == b"VP8 " and body[3:6] == b"\x9d\x01\x2a":  # lossy: after the frame tag, 14-bit sizes
        width, height = int.from_bytes(body[6:8], "little") & 0x3FFF, int.from_bytes(body[8:10], "little") & 0x3FFF
        return ImageHeader("WEBP", width, height, "RGB", 1) if width and height else None
    return None


def _webp_frames(data: bytes, stop_at: int) -> int:
    """An animated WebP's ANMF chunks, counted up to `stop_at`."""
    frames, pos = 0, 12
    while pos + 8 <= len(data) and frames < stop_at:
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        frames += data[pos : pos + 4] == b"ANMF"
        pos += 8 + size + (size & 1)
    return frames


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
