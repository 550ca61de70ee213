"""Videos to the patches a Qwen3-VL vision tower reads (Qwen3.5), as Hugging Face's
Qwen3VLVideoProcessor (and mlx-vlm's numpy port of it) makes them.

A video is a container (MP4, WebM, MOV, MKV, AVI: whatever PyAV's FFmpeg reads) or a list of
frames (encoded images, taken as `fps` frames a second). `read_video_header` reads the container's
header (size, frame count, frame rate), so a video's frames, grid and tokens are known before one
frame is decoded; `sample_indices` picks frames at the checkpoint's `fps` (between `min_frames`
and `max_frames`, evenly spread, Hugging Face's rule), `decode_frames` decodes only up to the last
of them, keeping the picked ones as RGB. Each frame is resized (bicubic) to one size whose area
times the frame count fits `max_pixels`, rescaled, normalized; the last frame repeats to fill a
temporal patch; every two frames make one temporal patch of the grid (t, h, w). Each temporal
patch is a run of pad tokens in the prompt after its timestamp, the mean of its frames' times
(`timestamps`).

PyAV (FFmpeg's libraries, bundled in its wheels) decodes: no format worth taking can be decoded
with our own code. It runs on api/media.py's threads, never on the event loop.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from PIL import Image

from model.vision.header import ImageError
from model.vision.preprocess import MAX_ASPECT_RATIO, DecodeCost, PreparedImage, pixel_keys

MAX_SOURCE_PIXELS = 4096 * 4096  # a frame's, before resizing
# `prepare_video`'s memory per resized pixel of all frames: the uint8 frames, their float32 copy
# and its padded copy, the float32 patches (tests/model/test_video_cost.py checks the bill).
RESIZED_BYTES_PER_PIXEL = 3 * (1 + 4 + 4 + 4)
# While frames decode (one thread: FFmpeg's threads would hold a frame each): the decoder's
# reference frames and buffers, a frame's RGB copy and PIL's, measured at 16-21 bytes a pixel
# for H.264 and VP9 from 320x240 to 1920x1080, on top of a few MiB for the codec itself.
SOURCE_BYTES_PER_PIXEL = 24
DECODER_BYTES = 8 << 20


@attrs.frozen
class VideoProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32  # all frames' resized pixels
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def read(cls, model_dir: Path) -> VideoProcessorConfig:
        """video_preprocessor_config.json's keys (else preprocessor_config.json's, older checkpoints)."""
        raw: dict[str, Any] = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.exists():
                raw = json.loads(path.read_text(encoding="utf-8"))
                break
        d = cls()
        return cls(
            **pixel_keys(raw, d),
            fps=float(raw.get("fps") or d.fps),
            min_frames=int(raw.get("min_frames", d.min_frames)),
            max_frames=int(raw.get("max_frames", d.max_frames)),
        )


@attrs.frozen
class VideoHeader:
    width: int
    height: int
    frames: int  # in the stream (its header's count, else duration x rate)
    fps: float  # the stream's average frame rate

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


def _open(data: bytes) -> Any:
    import av  # (FFmpeg: imported on first use, on a media thread)

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # PyAV raises many types for what is not a video
        raise ImageError(f"cannot decode video: {e}") from None
    if not container.streams.video:
        container.close()
        raise ImageError("cannot decode video: it has no video stream")
    return container


def read_video_header(data: bytes) -> VideoHeader:
    """The container's video stream as its header states it (nothing decoded). Raises ImageError."""
    container = _open(data)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if not rate or not width or not height:
            raise ImageError("cannot decode video: its stream states no frame rate or size")
        frames = int(stream.frames or 0)
        if frames <= 0:  # (WebM, MKV state no count: the duration at the rate)
            seconds = Fraction(container.duration or 0, 10**6)  # (the container's, in microseconds)
            duration = stream.duration * stream.time_base if stream.duration else seconds
            frames = int(round(float(duration) * float(rate)))
        if frames <= 0:
            raise ImageError("cannot decode video: its stream states no frames or duration")
        return VideoHeader(width, height, frames, float(rate))
    finally:
        container.close()


def sample_indices(total: int, source_fps: float, config: VideoProcessorConfig) -> list[int]:
    """The frames to take (Hugging Face's Qwen3-VL rule): `config.fps` a second, at least
    `min_frames` and at most `max_frames` (and the frames there are), evenly spread."""
    n = int(total / source_fps * config.fps)
    n = min(max(n, config.min_frames), config.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def timestamps(indices: Sequence[int], source_fps: float, temporal: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the last
    frame repeats to fill the last patch)."""
    padded = [*indices, *[indices[-1]] * (-len(indices) % temporal)]
    times = [i / source_fps for i in padded]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def resized_size(frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
    """Every frame's (height, width): multiples of patch * merge, all frames' area within the bounds."""
    factor = config.patch_size * config.merge_size
    if height < factor or width < factor:
        raise ImageError(f"video frames are {width}x{height}: each side must be at least {factor} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"video aspect ratio must be below {MAX_ASPECT_RATIO}, got {height}x{width}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = math.ceil(frames / config.temporal_patch_size) * config.temporal_patch_size
    if t_bar * h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((frames * height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int, int]:
    """The patch grid (t, h, w) `prepare_video` makes of `frames` frames of height x width."""
    rh, rw = resized_size(frames, height, width, config)
    return -(-frames // config.temporal_patch_size), rh // config.patch_size, rw // config.patch_size


def decode_cost(frames: int, height: int, width: int, config: VideoProcessorConfig) -> DecodeCost:
    """An upper bound of decoding and preparing `frames` frames of height x width."""
    t, gh, gw = grid_for(frames, height, width, config)
    resized = t * config.temporal_patch_size * gh * gw * config.patch_size**2
    output = resized * 3 * 4
    source = height * width * SOURCE_BYTES_PER_PIXEL + DECODER_BYTES
    return DecodeCost(peak=source + resized * RESIZED_BYTES_PER_PIXEL, output=output)


def decode_frames(data: bytes, indices: Sequence[int], size: tuple[int, int]) -> list[np.ndarray]:
    """The frames at `indices` (ascending) of a container, each resized (bicubic) to `size` =
    (height, width) as an [H, W, 3] uint8 array; frames the stream lacks repeat its last. Decoding
    stops after the last index. Raises ImageError."""
    wanted, last_index = set(indices), max(indices)
    kept: dict[int, np.ndarray] = {}
    last: np.ndarray | None = None
    container = _open(data)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "NONE"  # (one thread: bounded memory, and the cores are shared)
        for i, frame in enumerate(container.decode(stream)):
            if i > last_index:
                break
            if i not in wanted:
                continue
            if frame.width * frame.height > MAX_SOURCE_PIXELS:
                raise ImageError(f"video frames are {frame.width}x{frame.height}: over {MAX_SOURCE_PIXELS} pixels")
            last = kept[i] = _resized(frame.to_ndarray(format="rgb24"), size)
    except ImageError:
        raise
    except Exception as e:  # corrupt data past the header
        raise ImageError(f"cannot decode video: {e}") from None
    finally:
        container.close()
    if last is None:
        raise ImageError("cannot decode video: no frame decodes")
    out = []
    for i in indices:
        last = kept.get(i, last)
        out.append(last)
    return out


def decode_frame_list(images: Sequence[bytes], max_pixels: int) -> list[np.ndarray]:
    """A video given as encoded frames (PNG, JPEG, WebP, GIF: model/vision/header.py), each an
    [H, W, 3] uint8 array. Raises ImageError (a frame that does not decode, frames of two sizes)."""
    from model.vision.preprocess import decode_image

    out: list[np.ndarray] = []
    for i, data in enumerate(images):
        try:
            frame = np.asarray(decode_image(data, max_pixels))
        except ImageError as e:
            raise ImageError(f"frame {i + 1}: {e}") from None
        if out and frame.shape != out[0].shape:
            raise ImageError(f"frame {i + 1} is {frame.shape[1]}x{frame.shape[0]}: a video's frames share one size")
        out.append(frame)
    return out


def resize_frames(frames: Sequence[np.ndarray], size: tuple[int, int]) -> list[np.ndarray]:
    return [_resized(frame, size) for frame in frames]


def _resized(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    height, width = size
    if rgb.shape[:2] == (height, width):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((width, height), resample=Image.Resampling.BICUBIC))


def prepare_video(frames: Sequence[np.ndarray], config: VideoProcessorConfig) -> PreparedImage:
    """[H, W, 3] uint8 frames of one size (resized by `resized_size`) -> rescaled, normalized,
    flattened patches and the grid (t, h, w), as the reference processor makes them."""
    c = config
    video = np.stack(frames).transpose(0, 3, 1, 2).astype(np.float32)  # [T, C, H, W]
    video *= np.float32(c.rescale_factor)
    video -= np.array(c.image_mean, dtype=np.float32)[None, :, None, None]
    video /= np.array(c.image_std, dtype=np.float32)[None, :, None, None]
    pad = -video.shape[0] % c.temporal_patch_size
    if pad:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    frames_, channels, height, width = video.shape
    ps, tps, ms = c.patch_size, c.temporal_patch_size, c.merge_size
    t, gh, gw = frames_ // tps, height // ps, width // ps
    patches = video.reshape(t, tps, channels, gh // ms, ms, ps, gw // ms, ms, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return PreparedImage(np.ascontiguousarray(patches).reshape(t * gh * gw, channels * tps * ps * ps), (t, gh, gw))
