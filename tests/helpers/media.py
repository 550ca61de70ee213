"""Media for end-to-end tests: encoded test images, and what the engine answers for a prompt with
them when the prompt is built by hand (template, pad expansion), for comparing with a server."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

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
