"""A real server on the tiny Qwen3.5 checkpoint with its vision tower: an OpenAI image part, and a
video_url part (an MP4), run through the template, the placeholder expansion, the worker and the
engine, and answer exactly what the engine gives for the same tokens and media (the engine's
tests check cache hits: a hybrid model's state cache restores only a prefix it ends at exactly);
/v1/models says vision and video."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.vlm import write_qwen3_5_vl_dir
from tests.helpers.media import encode_video, engine_answer, engine_video_answer, noise_frames, png
from tests.live_http import serve_in_thread

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_5_vl_dir(tmp_path_factory.mktemp("qwen3_5_e2e") / "qwen3_5")


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    with serve_in_thread(model_dir, served_model_name=("m",)) as url:
        yield url


def chat(base: str, part: dict, text: str = "what is it?") -> dict:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
        "max_tokens": 12,
        "temperature": 0,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def test_an_image_answers_what_the_engine_does(base, model_dir):
    first = chat(base, image_part(png(1)))
    answer = first["choices"][0]["message"]["content"]
    assert answer and answer == engine_answer(model_dir, IMAGE_PLACEHOLDER + "what is it?", [png(1)])
    other = chat(base, image_part(png(2)))["choices"][0]["message"]["content"]
    assert other == engine_answer(model_dir, IMAGE_PLACEHOLDER + "what is it?", [png(2)]) != answer
    models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    assert models["vision"] is True


def test_a_video_answers_what_the_engine_does(base, model_dir):
    pytest.importorskip("av", reason="PyAV decodes video")
    data = encode_video(noise_frames(25), fps=10)
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    answer = chat(base, part, "what happens?")["choices"][0]["message"]["content"]
    assert answer and answer == engine_video_answer(model_dir, data, "what happens?")
    models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    assert models["video"] is True and models["audio"] is False
