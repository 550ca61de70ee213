"""A real server on the tiny Gemma 4 checkpoint with its vision and audio towers: an OpenAI
image_url part and an input_audio part (a WAV) run through the template (Gemma's own
placeholders), the placeholder expansion, the worker and the engine, and answer exactly what the
engine gives for the same tokens and media; /v1/models says vision and audio."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache.prompt_cache import PromptCache
from model.audio.decode import decode_audio
from model.audio.features import AudioFeatureConfig, log_mel
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import ImageInput, RowSpec
from model.load.loader import load_model
from model.text.tokenizer import Tokenizer
from model.vision.gemma4 import Gemma4ImageConfig
from model.vision.preprocess import decode_image
from tests.engine_helpers import generate_tokens
from tests.fixtures.vlm import write_gemma4_dir
from tests.helpers.media import png
from tests.helpers.media_api import wav
from tests.live_http import serve_in_thread

pytest.importorskip("av", reason="PyAV decodes audio")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma4_dir(tmp_path_factory.mktemp("gemma4_e2e") / "gemma4")


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    with serve_in_thread(model_dir, served_model_name=("m",)) as url:
        yield url


def chat(base: str, part: dict) -> str:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def engine_answer(model_dir: Path, item: ImageInput) -> str:
    """The engine's answer when the prompt is built by hand: Gemma's placeholder in the text,
    grown into the open token, the item's pads, the close token."""
    tokenizer = Tokenizer.from_dir(model_dir)
    model: Any = load_model(model_dir).model
    image = item.kind == "image"
    pad = model.image_token_id if image else model.audio_token_id
    ids = model.ids
    open_, close = (ids["boi_token_id"], ids["eoi_token_id"]) if image else (ids["boa_token_id"], ids["eoa_token_id"])
    placeholder = tokenizer.decode([pad], skip_special_tokens=False)
    text = tokenizer.render_chat([{"role": "user", "content": placeholder + "what is it?"}], add_generation_prompt=True)
    tokens = tokenizer.encode(text, add_special_tokens=True)
    at = tokens.index(pad)
    tokens[at : at + 1] = [open_, *[pad] * item.runs[0], close]
    spec = RowSpec(0, tuple(tokens), SamplingParams(temperature=0.0), MAX_TOKENS, images=(item,))
    engine = Engine(model, eos_token_ids=tokenizer.eos_token_ids, prompt_cache=PromptCache(1 << 20))
    stream, text = tokenizer.detokenizer(), ""  # (as the server's text pipeline reads them)
    for token in generate_tokens(engine, [spec])[0]:
        if token not in tokenizer.eos_token_ids:
            stream.add_token(token)
            text += stream.last_segment
    stream.finalize()
    return text + stream.last_segment


def test_an_image_answers_what_the_engine_does(base, model_dir):
    data = png(1)
    config = Gemma4ImageConfig.read(model_dir)
    prepared = config.prepare(decode_image(data))
    digest = hashlib.sha256(data).hexdigest()
    item = ImageInput(prepared.pixel_values, prepared.grid_thw, digest, "image", config.runs(prepared.grid_thw))
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    answer = chat(base, part)
    assert answer and answer == engine_answer(model_dir, item)


def test_an_audio_clip_answers_what_the_engine_does(base, model_dir):
    data = wav(1.3, rate=22_050, channels=2)
    config = AudioFeatureConfig.read(model_dir)
    samples = decode_audio(data)
    features = log_mel(samples, config)
    grid = (1, features.shape[0], config.valid_frames(len(samples)))
    item = ImageInput(features, grid, hashlib.sha256(data).hexdigest(), "audio", (config.tokens(len(samples)),))
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    answer = chat(base, part)
    assert answer and answer == engine_answer(model_dir, item)
    card = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    assert (card["vision"], card["video"], card["audio"]) == (True, False, True)
