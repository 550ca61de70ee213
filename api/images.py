"""Media in chat requests (images, videos, audio clips) for a model that takes them: each protocol's
media parts, their bytes, and the prompt's media tokens.

A translator turns each media part into an `ImagePart` (its kind and bytes, or the 400 it earns)
and puts the kind's `PLACEHOLDERS` text in the message text where the part was; a model whose
placeholder is another text (Gemma 4's `<|image|>`) gets its own in the prompt it renders
(`localized`), so any template renders the same prompt from text.

Then, before anything is decoded, `plan_images` reads each item's header: the model must take
its kind; an image must be a PNG, JPEG, WebP or GIF within `MAX_SOURCE_PIXELS` and `MAX_FRAMES`; a
video a container PyAV reads (or a list of such images), at most `MAX_VIDEO_SECONDS` long; an
audio clip WAV or MP3, at most `MAX_AUDIO_SECONDS`. The header gives the item's grid under the
model's resize rules, its prompt tokens (one run of pad tokens, or one per video frame pair with
its timestamp) and what decoding it costs in memory. `expanded_length` is the prompt's length once
each placeholder grows into its item's runs, so a prompt that cannot fit is refused undecoded, and
`request_bytes` is the request's bill (api/media.py decodes under it). `prepare_images` (a media
thread's work) decodes the items into the engine's `ImageInput`s, and `expand` grows the
placeholders. Only inline (base64) data is taken: the server fetches nothing over the network.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from actors.worker_api import ModelInfo
from api.errors import ApiError, bad_request
from api.template_messages import media_error
from model.audio.decode import FORMATS as AUDIO_FORMATS
from model.audio.decode import SAMPLE_RATE, AudioError, decode_audio, read_audio_header
from model.audio.features import log_mel
from model.engine.rows import ImageInput
from model.media import KindLayout, MediaLayout
from model.text.tokenizer import ChatTokenizer
from model.vision import video
from model.vision.header import ImageError, read_header
from model.vision.preprocess import DecodeCost

PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}
PLACEHOLDER = PLACEHOLDERS["image"]
MAX_IMAGES = 8  # media items per request, every kind counted
MAX_BASE64_CHARS = 20 * 1024 * 1024  # one image's encoded data (a video frame's too)
MAX_VIDEO_BASE64_CHARS = 64 * 1024 * 1024
MAX_AUDIO_BASE64_CHARS = 16 * 1024 * 1024
MAX_SOURCE_PIXELS = 8192 * 8192  # before resizing (the model's own max_pixels applies after)
MAX_FRAMES = 1000  # an animated image's (only the first is read; this bounds the header walk)
MAX_VIDEO_SECONDS = 600.0
MAX_AUDIO_SECONDS = 30.0  # Gemma 4's processor reads 30 s at most (750 tokens of 40 ms)
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
VIDEO_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo", "video/mpeg")
FRAMES_TYPE = "video/jpeg"  # vLLM's: base64 frames, comma-separated, each an image
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
_CODES = {"image": "invalid_image", "video": "invalid_video", "audio": "invalid_audio"}


@attrs.frozen(eq=False)
class ImagePart:
    kind: str  # the content part's type (a text-only model's 400 names it)
    param: str  # the request field it came in ("messages", "input")
    data: bytes = b""
    error: ApiError | None = None  # why it cannot be used (raised only on a model that takes media)
    media: str = "image"  # "image" | "video" | "audio"
    frames: tuple[bytes, ...] = ()  # a video given as frames (each an encoded image)
    format: str = ""  # an audio clip's ("wav", "mp3")


def _bad(kind: str, param: str, message: str, media: str = "image") -> ImagePart:
    return ImagePart(kind, param, error=bad_request(message, param=param, code=_CODES[media]), media=media)


def _data_url(url: Any, kind: str, where: str, param: str, media: str) -> tuple[str, str] | ImagePart:
    """(media type, base64 data) of a base64 `data:` URL, else the part's 400."""
    if not isinstance(url, str):
        return _bad(kind, param, f"{where}: the {media} URL must be a string", media)
    if url[:8].lower().startswith(("http://", "https://")):
        return _bad(
            kind,
            param,
            f"{where}: {media} URLs are not fetched (this server makes no network requests); "
            f"send the {media} inline as a base64 data: URL",
            media,
        )
    match = _DATA_URL.match(url)
    if match is None:
        example = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}[media]
        return _bad(kind, param, f"{where}: the {media} must be a data: URL (data:{example};base64,...)", media)
    if "base64" not in match.group(2).lower().split(";"):
        return _bad(kind, param, f"{where}: the {media} data: URL must be base64 encoded (;base64,)", media)
    return match.group(1).lower(), url[match.end() :]


def _decoded(data: Any, limit: int, kind: str, where: str, param: str, media: str) -> bytes | ImagePart:
    if not isinstance(data, str):
        return _bad(kind, param, f"{where}: the {media} data must be a base64 string", media)
    if len(data) > limit:
        return _bad(kind, param, f"{where}: the {media} data is over {limit // (1024 * 1024)} MB of base64", media)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return _bad(kind, param, f"{where}: the {media} data is not valid base64", media)


def from_url(url: Any, kind: str, where: str, param: str) -> ImagePart:
    """An image part given as a URL: only a base64 `data:` URL is taken."""
    parsed = _data_url(url, kind, where, param, "image")
    return parsed if isinstance(parsed, ImagePart) else from_base64(parsed[1], parsed[0], kind, where, param)


def from_base64(data: Any, media_type: Any, kind: str, where: str, param: str) -> ImagePart:
    """An image part given as base64 data and its media type."""
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        return _bad(kind, param, f"{where}: unsupported image type {media_type!r} (png, jpeg, webp or gif)")
    raw = _decoded(data, MAX_BASE64_CHARS, kind, where, param, "image")
    return raw if isinstance(raw, ImagePart) else ImagePart(kind, param, raw)


def video_from_url(url: Any, kind: str, where: str, param: str) -> ImagePart:
    """A video part given as a URL: a base64 `data:` URL of a container (video/mp4, ...), or
    vLLM's `data:video/jpeg;base64,<frame>,<frame>,...` (each frame an image)."""
    parsed = _data_url(url, kind, where, param, "video")
    if isinstance(parsed, ImagePart):
        return parsed
    media_type, data = parsed
    if media_type == FRAMES_TYPE:
        return video_from_frames([f"data:image/jpeg;base64,{f}" for f in data.split(",")], kind, where, param)
    if media_type not in VIDEO_TYPES:
        types = ", ".join((*VIDEO_TYPES, FRAMES_TYPE))
        return _bad(kind, param, f"{where}: unsupported video type {media_type!r} ({types})", "video")
    raw = _decoded(data, MAX_VIDEO_BASE64_CHARS, kind, where, param, "video")
    return raw if isinstance(raw, ImagePart) else ImagePart(kind, param, raw, media="video")


def video_from_frames(frames: Any, kind: str, where: str, param: str) -> ImagePart:
    """A video given as a list of frames, each an image data URL (or {"url": ...})."""
    if not isinstance(frames, list) or not frames:
        return _bad(kind, param, f"{where}: a video's frames must be a non-empty array of image URLs", "video")
    out: list[bytes] = []
    for i, frame in enumerate(frames):
        url = frame.get("url", frame.get("image_url")) if isinstance(frame, dict) else frame
        url = url.get("url") if isinstance(url, dict) else url
        part = from_url(url, kind, f"{where} frame {i + 1}", param)
        if part.error is not None:
            return attrs.evolve(part, media="video")
        out.append(part.data)
    return ImagePart(kind, param, media="video", frames=tuple(out))


def audio_from_input(value: Any, kind: str, where: str, param: str) -> ImagePart:
    """OpenAI's `input_audio`: {"data": base64, "format": "wav" | "mp3"}."""
    if not isinstance(value, dict):
        return _bad(kind, param, f'{where}: input_audio must be {{"data": base64, "format": "wav"}}', "audio")
    fmt = value.get("format")
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS:
        return _bad(kind, param, f"{where}: unsupported audio format {fmt!r} (wav or mp3)", "audio")
    raw = _decoded(value.get("data"), MAX_AUDIO_BASE64_CHARS, kind, where, param, "audio")
    return raw if isinstance(raw, ImagePart) else ImagePart(kind, param, raw, media="audio", format=fmt.lower())


def from_part(part: Mapping[str, Any], kind: Any, where: str, param: str) -> ImagePart | None:
    """A video or audio content part, None for any other kind: `video_url` (a data: URL, vLLM's
    shape), `video` (a data: URL or a list of image URLs, Qwen's), `input_audio` (OpenAI's)."""
    if kind == "video_url":
        url = part.get("video_url")
        return video_from_url(url.get("url") if isinstance(url, dict) else url, kind, where, param)
    if kind == "video":
        value = part.get("video")
        if isinstance(value, list):
            return video_from_frames(value, kind, where, param)
        return video_from_url(value.get("url") if isinstance(value, dict) else value, kind, where, param)
    if kind == "input_audio":
        return audio_from_input(part.get("input_audio"), kind, where, param)
    if kind in ("audio_url", "audio"):  # (no OpenAI type: a 400 naming the one there is)
        message = f'{where}: audio comes as an input_audio part, {{"data": base64, "format": "wav" or "mp3"}}'
        return _bad(kind, param, message, "audio")
    return None


def layout(info: ModelInfo) -> MediaLayout:
    """The model's media layout (a vision model that states none: its image pad alone, Qwen2-VL's)."""
    if info.media_layout is not None:
        return info.media_layout
    return MediaLayout((("image", KindLayout((info.image_token_id,), info.image_token_id)),))


def check_vision(parts: Sequence[ImagePart], info: ModelInfo) -> None:
    """The 400s a request with these media earns before any decoding."""
    if not parts:
        return
    if not info.vision or info.image_processor is None:
        raise media_error(parts[0].kind)  # a text-only model: the same 400 as ever
    kinds = layout(info).names()
    for part in parts:
        if part.media not in kinds:
            raise bad_request(
                f"{part.kind} content parts are not supported: this model takes no {part.media} input "
                f"(it takes {', '.join(sorted(kinds))})",
                param=part.param,
                code="unsupported_content_type",
            )
    if len(parts) > MAX_IMAGES:
        raise bad_request(f"at most {MAX_IMAGES} images, videos or audio clips per request", param=parts[0].param)
    for part in parts:
        if part.error is not None:
            raise part.error


@attrs.frozen
class ImagePlan:
    """One item as its header says it will be: its grid, pad runs (each with its label's tokens)
    and decode cost; a video's frames to take and their size."""

    grid: tuple[int, int, int]
    runs: tuple[int, ...]
    cost: DecodeCost
    media: str = "image"
    labels: tuple[tuple[int, ...], ...] = ()  # each run's label tokens (a video frame pair's time)
    indices: tuple[int, ...] = ()  # a video's frames to decode
    size: tuple[int, int] = (0, 0)  # and their resized (height, width)

    @property
    def tokens(self) -> int:
        return sum(self.runs)


def plan_images(
    parts: Sequence[ImagePart], info: ModelInfo, tokenizer: ChatTokenizer | None = None
) -> tuple[ImagePlan, ...]:
    """Each item's plan, from its header alone (blocking, but nothing is decoded). Raises
    ApiError: a kind the model does not take, too many items, an unreadable header, too many
    pixels, frames or seconds. `tokenizer` tokenizes run labels (a video's timestamps)."""
    check_vision(parts, info)
    plans = []
    for i, part in enumerate(parts):
        try:
            plans.append(_plan(part, info, tokenizer))
        except (ImageError, AudioError) as e:
            raise _item_error(i, part, e) from None
    return tuple(plans)


def _plan(part: ImagePart, info: ModelInfo, tokenizer: ChatTokenizer | None) -> ImagePlan:
    if part.media == "image":
        processor = info.image_processor
        assert processor is not None  # (check_vision)
        header = read_header(part.data, max_pixels=MAX_SOURCE_PIXELS, max_frames=MAX_FRAMES)
        grid = processor.grid(header.height, header.width)
        return ImagePlan(grid, processor.runs(grid), processor.cost(header))
    if part.media == "audio":
        audio = info.audio_processor
        assert audio is not None  # (the model takes audio)
        clip = read_audio_header(part.data, part.format)
        if clip.seconds > MAX_AUDIO_SECONDS:
            raise AudioError(f"audio is {clip.seconds:.1f} s long: at most {MAX_AUDIO_SECONDS:.0f} s")
        samples = math.ceil(clip.seconds * SAMPLE_RATE)
        source = math.ceil(clip.seconds * clip.rate) * clip.channels
        # The decoded source and its resampled copies (float32), the features and FFT frames.
        cost = DecodeCost(peak=source * 12 + samples * 64 + 4 * 1024 * 1024, output=samples * 4)
        return ImagePlan((1, 1, 1), (max(audio.tokens(samples), 1),), cost, "audio")
    config = info.video_processor
    assert config is not None  # (the model takes video)
    if part.frames:
        headers = [read_header(f, max_pixels=MAX_SOURCE_PIXELS, max_frames=MAX_FRAMES) for f in part.frames]
        if len(headers) > config.max_frames:
            raise ImageError(f"the video has {len(headers)} frames: at most {config.max_frames}")
        if len({(h.width, h.height) for h in headers}) > 1:
            raise ImageError("a video's frames must share one size")
        count, height, width, fps = len(headers), headers[0].height, headers[0].width, config.fps
        indices = list(range(count))
    else:
        stream = video.read_video_header(part.data)
        if stream.seconds > MAX_VIDEO_SECONDS:
            raise ImageError(f"the video is {stream.seconds:.1f} s long: at most {MAX_VIDEO_SECONDS:.0f} s")
        if stream.width * stream.height > video.MAX_SOURCE_PIXELS:
            raise ImageError(f"video frames are {stream.width}x{stream.height}: over {video.MAX_SOURCE_PIXELS} pixels")
        indices = video.sample_indices(stream.frames, stream.fps, config)
        count, height, width, fps = len(indices), stream.height, stream.width, stream.fps
    size = video.resized_size(count, height, width, config)
    grid = video.grid_for(count, height, width, config)
    kind = layout(info).get("video")
    labels: list[tuple[int, ...]] = []
    if kind is not None and kind.label and tokenizer is not None:
        for seconds in video.timestamps(indices, fps, config.temporal_patch_size):
            labels.append(tuple(tokenizer.encode(kind.label.format(seconds=seconds), add_special_tokens=False)))
    runs = (grid[1] * grid[2] // config.merge_size**2,) * grid[0]
    cost = video.decode_cost(count, height, width, config)
    return ImagePlan(grid, runs, cost, "video", tuple(labels), tuple(indices), size)


class MediaPrompt(Protocol):
    """A chat prompt (api/chat_request.py `ChatPrompt`), as far as its media go."""

    @property
    def messages(self) -> tuple[dict[str, Any], ...]: ...

    @property
    def images(self) -> tuple[ImagePart, ...]: ...


P = TypeVar("P", bound=MediaPrompt)


def localized(prompt: P, info: ModelInfo, tokenizer: ChatTokenizer) -> P:
    """`prompt` with each media placeholder in the model's own text (a no-op for Qwen's)."""
    if not prompt.images or info.media_layout is None:
        return prompt
    swaps = []
    for kind in {part.media for part in prompt.images}:
        own = info.media_layout.get(kind)
        if own is not None:
            text = tokenizer.decode(list(own.placeholder), skip_special_tokens=False)
            if text != PLACEHOLDERS[kind]:
                swaps.append((PLACEHOLDERS[kind], text))
    if not swaps:
        return prompt
    out = []
    for message in prompt.messages:
        content = message.get("content")
        if isinstance(content, str):
            for marker, text in swaps:
                content = content.replace(marker, text)
            message = {**message, "content": content}
        out.append(message)
    return attrs.evolve(prompt, messages=tuple(out))  # type: ignore[misc]


def _placeholders(tokens: Sequence[int], info: ModelInfo, media: Sequence[str], param: str) -> list[tuple[int, int]]:
    """The [start, end) of each media placeholder in the prompt, one per item in order. A 400
    when they are not exactly one per item of its kind (the text holds the model's media tokens,
    or the template dropped a message)."""
    kinds = layout(info)
    found: list[tuple[int, int, str]] = []
    pads = 0
    for name, kind in kinds.kinds:
        at = kind.placeholder.index(kind.pad)
        for i, token in enumerate(tokens):
            if token != kind.pad:
                continue
            pads += 1
            start = i - at
            if start >= 0 and tuple(tokens[start : start + len(kind.placeholder)]) == kind.placeholder:
                found.append((start, start + len(kind.placeholder), name))
    found.sort()
    if pads != len(media) or [name for _, _, name in found] != list(media):
        raise bad_request(
            f"the prompt has {pads} image placeholders for {len(media)} media items "
            "(message text must not contain the model's image, video or audio tokens)",
            param=param,
        )
    return [(start, end) for start, end, _ in found]


def _expansion(kind: KindLayout, runs: Sequence[int], labels: Sequence[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for i, run in enumerate(runs):
        out += kind.run_tokens(run, list(labels[i]) if i < len(labels) else [])
    return out


def expanded_length(tokens: Sequence[int], plans: Sequence[ImagePlan], info: ModelInfo, param: str) -> int:
    """The length `expand` will give the prompt (an audio clip's tokens as its header says).
    Raises ApiError when the placeholders are not one per item."""
    media = [plan.media for plan in plans]
    spans = _placeholders(tokens, info, media, param)
    kinds = layout(info)
    grown = 0
    for (start, end), plan, name in zip(spans, plans, media):
        kind = kinds.get(name)
        assert kind is not None
        grown += len(_expansion(kind, plan.runs, plan.labels)) - (end - start)
    return len(tokens) + grown


def request_bytes(plans: Sequence[ImagePlan]) -> int:
    """The memory decoding these items takes at most: one after another, each one's peak on top
    of the outputs already made."""
    if not plans:
        return 0
    return sum(p.cost.output for p in plans) + max(p.cost.peak - p.cost.output for p in plans)


def prepare_images(parts: Sequence[ImagePart], plans: Sequence[ImagePlan], info: ModelInfo) -> tuple[ImageInput, ...]:
    """Decoded, resized, patched items (blocking: run it on a media thread; `plan_images` first).
    Raises ApiError."""
    out = []
    for i, (part, plan) in enumerate(zip(parts, plans)):
        try:
            out.append(_prepare(part, plan, info))
        except (ImageError, AudioError) as e:
            raise _item_error(i, part, e) from None
    return tuple(out)


def _prepare(part: ImagePart, plan: ImagePlan, info: ModelInfo) -> ImageInput:
    digest = hashlib.sha256(part.data if not part.frames else b"".join(_framed(part.frames))).hexdigest()
    if part.media == "image":
        processor = info.image_processor
        assert processor is not None
        prepared = processor.load(part.data, MAX_SOURCE_PIXELS)
        return ImageInput(prepared.pixel_values, prepared.grid_thw, digest, "image", processor.runs(prepared.grid_thw))
    if part.media == "audio":
        config = info.audio_processor
        assert config is not None
        samples = decode_audio(part.data)
        if len(samples) > MAX_AUDIO_SECONDS * SAMPLE_RATE + SAMPLE_RATE // 10:  # (the header lied)
            raise AudioError(f"audio is {len(samples) / SAMPLE_RATE:.1f} s long: at most {MAX_AUDIO_SECONDS:.0f} s")
        tokens = config.tokens(len(samples))
        if tokens < 1:
            raise AudioError("audio is too short: under 40 ms")
        features = log_mel(samples, config)
        grid = (1, features.shape[0], config.valid_frames(len(samples)))
        return ImageInput(features, grid, digest, "audio", (tokens,))
    config_v = info.video_processor
    assert config_v is not None
    if part.frames:
        frames = video.resize_frames(video.decode_frame_list(part.frames, MAX_SOURCE_PIXELS), plan.size)
    else:
        frames = video.decode_frames(part.data, plan.indices, plan.size)
    prepared = video.prepare_video(frames, config_v)
    return ImageInput(prepared.pixel_values, prepared.grid_thw, digest, "video", plan.runs)


def _framed(frames: Sequence[bytes]) -> list[bytes]:
    return [len(f).to_bytes(8, "little") + f for f in frames]


def _item_error(index: int, part: ImagePart, error: ValueError) -> ApiError:
    return bad_request(f"{part.media} {index + 1}: {error}", param=part.param, code=_CODES[part.media])


def expand(
    tokens: Sequence[int], images: Sequence[ImageInput], plans: Sequence[ImagePlan], info: ModelInfo, param: str
) -> tuple[list[int], Callable[[int], int]]:
    """The prompt with each item's placeholder grown into its runs (each with its label, open and
    close tokens), and where a position of the unexpanded prompt moves to. A prompt whose
    placeholders are not exactly one per item is a 400."""
    spans = _placeholders(tokens, info, [i.kind for i in images], param)
    kinds = layout(info)
    out: list[int] = []
    start = 0
    grown: list[tuple[int, int]] = []  # (placeholder start, tokens added)
    for (at, end), image, plan in zip(spans, images, plans):
        kind = kinds.get(image.kind)
        assert kind is not None
        expansion = _expansion(kind, image.runs or plan.runs, plan.labels)
        out += tokens[start:at]
        out += expansion
        grown.append((at, len(expansion) - (end - at)))
        start = end
    out += tokens[start:]

    def moved(position: int) -> int:
        return position + sum(added for at, added in grown if at < position)

    return out, moved
