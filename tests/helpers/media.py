"""Media for end-to-end tests: encoded test images, and what the engine answers for a prompt with
them when the prompt is built by hand (template, pad expansion), for comparing with a server."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import ImageInput, RowSpec
from model.load.loader import load_model
from model.text.tokenizer import Tokenizer
from model.vision.preprocess import ImageProcessorConfig, decode_image, prepare_image
from tests.engine_helpers import generate_tokens


def png(seed: int, height: int = 168, width: int = 224) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def engine_answer(model_dir: Path, content: str, images: list[bytes], max_tokens: int = 12) -> str:
    """The engine's greedy answer to one user message `content` whose Qwen image placeholders
    stand for `images` (each placeholder's pad grown to its grid's tokens)."""
    tokenizer = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir).model
    config = ImageProcessorConfig.read(model_dir)
    tokens = tokenizer.encode(
        tokenizer.render_chat([{"role": "user", "content": content}], add_generation_prompt=True),
        add_special_tokens=True,
    )
    inputs = []
    for data in images:
        prepared = prepare_image(decode_image(data), config)
        at = tokens.index(model.image_token_id)
        tokens[at : at + 1] = [model.image_token_id] * prepared.token_count(config.merge_size)
        inputs.append(ImageInput(prepared.pixel_values, prepared.grid_thw, hashlib.sha256(data).hexdigest()))
    spec = RowSpec(0, tuple(tokens), SamplingParams(temperature=0.0), max_tokens, images=tuple(inputs))
    engine = Engine(model, eos_token_ids=tokenizer.eos_token_ids, prompt_cache=PromptCache(1 << 20))
    return tokenizer.decode(generate_tokens(engine, [spec])[0], skip_special_tokens=True)


def noise_frames(count: int, height: int = 96, width: int = 128, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def encode_video(frames: list[np.ndarray], fps: Any = 10, codec: str = "mpeg4", container: str = "mp4") -> bytes:
    """Frames encoded as a video file (PyAV)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def engine_video_answer(model_dir: Path, data: bytes, text: str, max_tokens: int = 12) -> str:
    """The engine's greedy answer to one user message: a Qwen3.5 video placeholder, then `text`,
    the placeholder grown by hand as Qwen3-VL's processor renders a video (each frame pair's
    "<t seconds>", then its pads between vision start and end)."""
    from model.vision.video import (
        VideoProcessorConfig,
        decode_frames,
        prepare_video,
        read_video_header,
        resized_size,
        sample_indices,
        timestamps,
    )

    tokenizer = Tokenizer.from_dir(model_dir)
    model: Any = load_model(model_dir).model
    config = VideoProcessorConfig.read(model_dir)
    header = read_video_header(data)
    indices = sample_indices(header.frames, header.fps, config)
    size = resized_size(len(indices), header.height, header.width, config)
    prepared = prepare_video(decode_frames(data, indices, size), config)
    t, h, w = prepared.grid_thw
    vs, ve, pad = model.vision_start_token_id, model.vision_end_token_id, model.video_token_id
    content = "<|vision_start|><|video_pad|><|vision_end|>" + text
    tokens = tokenizer.encode(
        tokenizer.render_chat([{"role": "user", "content": content}], add_generation_prompt=True),
        add_special_tokens=True,
    )
    grown: list[int] = []
    for seconds in timestamps(indices, header.fps, config.temporal_patch_size):
        grown += (
            tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False) + [vs] + [pad] * (h * w // 4) + [ve]
        )
    at = tokens.index(pad)
    tokens[at - 1 : at + 2] = grown
    digest = hashlib.sha256(data).hexdigest()
    item = ImageInput(prepared.pixel_values, prepared.grid_thw, digest, kind="video", runs=(h * w // 4,) * t)
    spec = RowSpec(0, tuple(tokens), SamplingParams(temperature=0.0), max_tokens, images=(item,))
    engine = Engine(model, eos_token_ids=tokenizer.eos_token_ids, prompt_cache=PromptCache(1 << 20))
    return tokenizer.decode(generate_tokens(engine, [spec])[0], skip_special_tokens=True)
