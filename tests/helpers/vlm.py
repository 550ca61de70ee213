"""Vision-language test inputs and mlx-vlm's greedy tokens (the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_vlm.generate.ar import generate_step
from PIL import Image

from model.families.qwen2_5_vl import Qwen25VLModel
from model.vision.preprocess import ImageProcessorConfig, prepare_image

N_TOKENS = 24


def noise_image(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


# 168x224: 48 tokens over windows with empty padding ones; 60x100: 8 tokens, one window.
IMAGES = [noise_image(168, 224, 1), noise_image(60, 100, 2)]


def prepared(vlm_dir: Path, images: list[Image.Image]):
    config = ImageProcessorConfig.read(vlm_dir)
    return [prepare_image(image, config) for image in images]


def prompt_with(model: Qwen25VLModel, counts: list[int]) -> list[int]:
    texts = [[5, 17, 42], [99, 3, 250], [11, 7]]
    prompt = list(texts[0])
    for i, n in enumerate(counts):
        prompt += [model.vision_start_token_id] + [model.image_token_id] * n + [model.vision_end_token_id]
        prompt += texts[i + 1]
    return prompt


def their_greedy(model, prompt: list[int], images) -> list[int]:
    pixels = mx.array(np.concatenate([p.pixel_values for p in images]))
    grids = mx.array([p.grid_thw for p in images])
    steps = generate_step(
        mx.array([prompt]), model, pixels, None, max_tokens=N_TOKENS, temperature=0.0, prefill_step_size=None,
        image_grid_thw=grids,
    )  # fmt: skip
    return [int(cast(Any, tok.item() if hasattr(tok, "item") else tok)) for tok, _ in steps]


def media_inputs(vlm_dir: Path, images: list[Image.Image]) -> tuple:
    """Images as the engine takes them (patches, grid, a content digest)."""
    import hashlib

    from model.engine.rows import ImageInput

    out = []
    for image, p in zip(images, prepared(vlm_dir, images)):
        out.append(ImageInput(p.pixel_values, p.grid_thw, hashlib.sha256(image.tobytes()).hexdigest()))
    return tuple(out)


def row_spec(row_id: int, prompt: list[int], images=(), max_tokens: int = N_TOKENS):
    from model.engine.params import SamplingParams
    from model.engine.rows import RowSpec

    return RowSpec(row_id, tuple(prompt), SamplingParams(), max_tokens, images=tuple(images))


def vlm_engine(model, *, cache=None, chunk: int = 2048):
    from model.engine.engine import Engine
    from model.options import EngineOptions

    return Engine(model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(prefill_chunk=chunk))
