"""Images judged from their headers alone (model/vision/header.py): format, size, mode and frames
come from a header whose pixel data is garbage (a WebP's from its chunks, as Pillow reads them),
so nothing here can have been decoded; pixel and frame limits and Pillow's decompression-bomb
guard are ImageErrors; the grid the header predicts is the grid decoding makes, and the lean
pipeline equals the reference one bit for bit."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

from model.vision.header import ImageError, gif_frames, read_header, webp_header
from model.vision.preprocess import ImageProcessorConfig, decode_image, grid_for, load_image, prepare_image
from tests.helpers.images import png_header

LIMIT = 8192 * 8192
CONFIG = ImageProcessorConfig(max_pixels=28 * 28 * 64)


def encoded(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def frames(n: int, size: int = 4) -> list[Image.Image]:
    return [Image.new("RGB", (size, size), (i * 37 % 256, 255 - i * 53 % 256, i % 7 * 30)) for i in range(n)]


def noise(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_size_mode_and_format_come_from_the_header_alone():
    header = read_header(png_header(8192, 8192), max_pixels=LIMIT, max_frames=10)
    assert (header.format, header.width, header.height, header.mode, header.frames) == ("PNG", 8192, 8192, "RGB", 1)
    assert read_header(png_header(300, 20, color_type=6), max_pixels=LIMIT, max_frames=10).mode == "RGBA"
    with pytest.raises(ImageError, match="cannot decode"):  # the same bytes do not decode
        decode_image(png_header(300, 20))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_reads_its_header(fmt):
    header = read_header(encoded(noise(30, 50), fmt), max_pixels=LIMIT, max_frames=10)
    assert (header.format, header.width, header.height, header.frames) == (fmt, 50, 30, 1)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO", "PPM"])
def test_formats_outside_the_four_are_refused(fmt):
    data = encoded(noise(16, 16), fmt)
    assert Image.open(io.BytesIO(data)).size == (16, 16)  # Pillow itself would read it
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        read_header(data, max_pixels=LIMIT, max_frames=10)
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        decode_image(data)


def test_pixels_over_the_limit_are_refused_from_the_header():
    assert read_header(png_header(8192, 8192), max_pixels=LIMIT, max_frames=1).pixels == LIMIT
    with pytest.raises(ImageError, match=f"8193x8192: over {LIMIT} pixels"):
        read_header(png_header(8193, 8192), max_pixels=LIMIT, max_frames=1)
    with pytest.raises(ImageError, match="over 100 pixels"):
        read_header(png_header(11, 10), max_pixels=100, max_frames=1)


@pytest.mark.parametrize("action", ["default", "error", "ignore"])
@pytest.mark.parametrize("side", [10_000, 20_000])  # past Pillow's warning (89.5 Mpx) / error (179 Mpx) limits
def test_pillows_decompression_bomb_guard_is_an_image_error(action, side):
    with warnings.catch_warnings():
        warnings.simplefilter(action)
        with pytest.raises(ImageError, match=f"over {LIMIT} pixels"):
            read_header(png_header(side, side), max_pixels=LIMIT, max_frames=1)
        with pytest.raises(ImageError, match=f"over {LIMIT} pixels"):
            decode_image(png_header(side, side), LIMIT)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "GIF"])
def test_frames_are_counted_and_bounded(fmt):
    options = {"lossless": True} if fmt == "WEBP" else {}
    shots = frames(6)
    data = encoded(shots[0], fmt, save_all=True, append_images=shots[1:], **options)
    assert read_header(data, max_pixels=LIMIT, max_frames=6).frames == 6
    with pytest.raises(ImageError, match="more than 5 frames"):
        read_header(data, max_pixels=LIMIT, max_frames=5)
    # An animated image is its first frame.
    first = np.asarray(decode_image(data))
    assert np.array_equal(first, np.asarray(decode_image(encoded(shots[0], fmt, **options))))


def webp_canvas(width: int, height: int) -> bytes:
    """An extended WebP whose header says width x height and that holds no image."""
    vp8x = bytes([0, 0, 0, 0]) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunks = b"VP8X" + len(vp8x).to_bytes(4, "little") + vp8x + b"VP8 " + (4).to_bytes(4, "little") + b"junk"
    return b"RIFF" + (4 + len(chunks)).to_bytes(4, "little") + b"WEBP" + chunks


def test_a_webps_header_is_read_from_its_chunks_as_pillow_reads_it():
    cases = [
        (noise(30, 50), {}),  # lossy: VP8
        (noise(30, 50), {"lossless": True}),  # VP8L
        (noise(7, 1).convert("RGBA"), {}),  # lossy with alpha: VP8X
        (noise(33, 17).convert("RGBA"), {"lossless": True}),
        (noise(1, 1), {}),
        (noise(3, 600), {"lossless": True}),
        (noise(20, 20), {"exif": Image.Exif().tobytes()}),
    ]
    for image, options in cases:
        data = encoded(image, "WEBP", **options)
        ours, pillow = webp_header(data, 10), Image.open(io.BytesIO(data))
        assert ours is not None and (ours.width, ours.height, ours.frames) == (*pillow.size, pillow.n_frames)
        assert ours.mode == pillow.mode
    assert webp_header(encoded(noise(8, 8), "PNG"), 10) is None


def test_a_huge_webp_canvas_is_refused_from_its_header():
    with pytest.raises(ImageError, match=f"16383x16383: over {LIMIT} pixels"):
        read_header(webp_canvas(16383, 16383), max_pixels=LIMIT, max_frames=1)
    assert read_header(webp_canvas(4000, 3000), max_pixels=LIMIT, max_frames=1).pixels == 12_000_000
    with pytest.raises(ImageError, match="cannot decode"):
        decode_image(webp_canvas(4000, 3000))


def test_a_gifs_frame_walk_stops_past_the_limit():
    shots = frames(40, size=2)
    data = encoded(shots[0], "GIF", save_all=True, append_images=shots[1:])
    assert Image.open(io.BytesIO(data)).n_frames == gif_frames(data, 1000) == 40
    assert gif_frames(data, 3) == 3
    assert gif_frames(data[:20], 1000) == 0  # cut inside the color table: no frame
    assert gif_frames(b"GIF89a", 1000) == 0


def test_corrupt_data_after_a_good_header_is_an_image_error():
    good = encoded(noise(64, 64), "PNG")
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(good[: len(good) // 2], CONFIG, LIMIT)  # truncated
    jpeg = encoded(noise(64, 64), "JPEG")
    cut = jpeg[: jpeg.index(b"\xff\xda") + 20]  # just into the scan
    assert read_header(cut, max_pixels=LIMIT, max_frames=1).width == 64  # the header is all there
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(cut, CONFIG, LIMIT)


@pytest.mark.parametrize(("height", "width"), [(168, 224), (60, 100), (1, 90), (1000, 700), (3000, 17), (20, 20)])
def test_the_headers_grid_is_the_decoded_grid(height, width):
    data = encoded(noise(height, width), "PNG")
    header = read_header(data, max_pixels=LIMIT, max_frames=1)
    for config in (CONFIG, ImageProcessorConfig()):
        assert grid_for(header.height, header.width, config) == load_image(data, config, LIMIT).grid_thw


def reference_patches(image: Image.Image, config: ImageProcessorConfig) -> np.ndarray:
    """The processor as Hugging Face writes it: resize, rescale, normalize, repeat, transpose."""
    from model.vision.preprocess import smart_resize

    c = config
    rgb = np.asarray(image.convert("RGB"))
    rh, rw = smart_resize(rgb.shape[0], rgb.shape[1], c.patch_size * c.merge_size, c.min_pixels, c.max_pixels)
    if (rh, rw) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((rw, rh), resample=Image.Resampling.BICUBIC))
    img = rgb.transpose(2, 0, 1).astype(np.float32) * np.float32(c.rescale_factor)
    img = (img - np.array(c.image_mean, np.float32)[:, None, None]) / np.array(c.image_std, np.float32)[:, None, None]
    ps, tps, ms = c.patch_size, c.temporal_patch_size, c.merge_size
    gh, gw = rh // ps, rw // ps
    patches = np.repeat(img[None, None], tps, axis=1).reshape(1, 1, tps, 3, gh // ms, ms, ps, gw // ms, ms, ps)
    return patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gh * gw, 3 * tps * ps * ps)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_the_lean_pipeline_equals_the_reference_bit_for_bit(mode):
    for i, (height, width) in enumerate([(168, 224), (333, 517), (1000, 700), (28, 28)]):
        image = noise(height, width, i).convert(mode)
        for config in (CONFIG, ImageProcessorConfig(), ImageProcessorConfig(min_pixels=200 * 200)):
            got = load_image(encoded(image, "PNG"), config, LIMIT).pixel_values
            assert np.array_equal(got, reference_patches(image, config))
            assert np.array_equal(prepare_image(image, config).pixel_values, got)
