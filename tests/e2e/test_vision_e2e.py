"""A real server on the tiny Qwen2.5-VL checkpoint: an OpenAI image part runs through the template,
the pad expansion, the worker and the engine, and answers exactly what the engine gives for the
same tokens and image; the same image again restores the prompt from the cache; /v1/models
says vision."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import ImageInput, RowSpec
from model.load.loader import load_model
from model.text.tokenizer import Tokenizer
from model.vision.preprocess import ImageProcessorConfig, decode_image, prepare_image
from tests.engine_helpers import generate_tokens
from tests.fixtures.vlm import write_vlm_dir
from tests.live_http import serve_in_thread

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 12


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (168, 224, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vlm_dir(tmp_path_factory.mktemp("vlm_e2e") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def base(vlm_dir: Path) -> Iterator[str]:
    with serve_in_thread(vlm_dir, served_model_name=("m",)) as url:
        yield url


def body(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def engine_answer(vlm_dir: Path, image: bytes) -> str:
    """What the engine answers for the same prompt, built by hand: template, then pad expansion."""
    tokenizer = Tokenizer.from_dir(vlm_dir)
    model = load_model(vlm_dir).model
    prepared = prepare_image(decode_image(image), ImageProcessorConfig.read(vlm_dir))
    text = tokenizer.render_chat([{"role": "user", "content": PLACEHOLDER + "what is it?"}], add_generation_prompt=True)
    tokens = tokenizer.encode(text, add_special_tokens=True)
    at = tokens.index(model.image_token_id)
    tokens[at : at + 1] = [model.image_token_id] * prepared.token_count(2)
    digest = hashlib.sha256(image).hexdigest()
    spec = RowSpec(
        0,
        tuple(tokens),
        SamplingParams(temperature=0.0),
        MAX_TOKENS,
        images=(ImageInput(prepared.pixel_values, prepared.grid_thw, digest),),
    )
    engine = Engine(model, eos_token_ids=tokenizer.eos_token_ids, prompt_cache=PromptCache(1 << 20))
    return tokenizer.decode(generate_tokens(engine, [spec])[0], skip_special_tokens=True)


def test_an_image_request_answers_what_the_engine_does(base, vlm_dir):
    first = httpx.post(f"{base}/v1/chat/completions", json=body(png(1)), timeout=60).json()
    answer = first["choices"][0]["message"]["content"]
    assert answer  # (not an immediate EOS: the comparisons below can fail)
    assert answer == engine_answer(vlm_dir, png(1))
    again = httpx.post(f"{base}/v1/chat/completions", json=body(png(1)), timeout=60).json()
    assert again["choices"][0]["message"]["content"] == answer
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 48  # past the image's 48 tokens
    other = httpx.post(f"{base}/v1/chat/completions", json=body(png(2)), timeout=60).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 48
    assert other["choices"][0]["message"]["content"] == engine_answer(vlm_dir, png(2)) != answer
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert models["data"][0]["vision"] is True
