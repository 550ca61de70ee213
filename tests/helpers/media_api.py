"""Video and audio requests against fake media models (a FakeWorker behind the real actors): a
Qwen3.5-like one (images and video, Qwen's placeholders) and a Gemma 4-like one (images and
audio, placeholders of its own), for the media API tests."""

from __future__ import annotations

import io
import re
import wave
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from actors.worker_api import ModelInfo
from api.app import create_app
from model.audio.features import AudioFeatureConfig
from model.media import KindLayout, MediaLayout
from model.vision.preprocess import ImageProcessorConfig
from model.vision.video import VideoProcessorConfig
from tests.fakes import EOS, FakeTokenizer, FakeWorker

SPECIAL = {
    "<|vision_start|>": 990,
    "<|vision_end|>": 991,
    "<|image_pad|>": 999,
    "<|video_pad|>": 998,
    "<|image|>": 980,  # Gemma 4's: the placeholder, then the run's open and close
    "<|image>": 981,
    "<image|>": 982,
    "<|audio|>": 983,
    "<|audio>": 984,
    "<audio|>": 985,
}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL) + ")")
VS, VE, IMAGE, VIDEO = 990, 991, 999, 998
G_IMAGE, BOI, EOI, AUDIO, BOA, EOA = 980, 981, 982, 983, 984, 985


class MediaTokenizer(FakeTokenizer):
    """Each of SPECIAL is one token, as in the real tokenizers."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        for piece in _SPLIT.split(text):
            out += [SPECIAL[piece]] if piece in SPECIAL else super().encode(piece)
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in SPECIAL.items()}
        return "".join(names[i] if i in names else super().decode([i]) for i in ids)


QWEN_LAYOUT = MediaLayout(
    (
        ("image", KindLayout((VS, IMAGE, VE), IMAGE, (VS,), (VE,))),
        ("video", KindLayout((VS, VIDEO, VE), VIDEO, (VS,), (VE,), "<{seconds:.1f} seconds>")),
    )
)
GEMMA_LAYOUT = MediaLayout(
    (
        ("image", KindLayout((G_IMAGE,), G_IMAGE, (BOI,), (EOI,))),
        ("audio", KindLayout((AUDIO,), AUDIO, (BOA,), (EOA,))),
    )
)
VIDEO_CONFIG = VideoProcessorConfig(min_pixels=64 * 64, max_pixels=32 * 32 * 96, max_frames=12)


def info(kind: str) -> ModelInfo:
    """A Qwen3.5-like ("qwen"), Gemma 4-like ("gemma") or text-only ("text") model."""
    media: dict[str, Any] = {}
    if kind == "qwen":
        media = {"media_layout": QWEN_LAYOUT, "image_token_id": IMAGE, "video_processor": VIDEO_CONFIG}
    elif kind == "gemma":
        media = {"media_layout": GEMMA_LAYOUT, "image_token_id": G_IMAGE, "audio_processor": AudioFeatureConfig()}
    if media:
        media |= {"vision": True, "image_processor": ImageProcessorConfig(max_pixels=28 * 28 * 64)}
    return ModelInfo(
        name=f"fake-{kind}",
        context_length=4096,
        weights_bytes=1_000_000,
        kv_bytes_per_token=1000,
        eos_token_ids=frozenset({EOS}),
        memory_bytes=10**12,
        **media,
    )


@asynccontextmanager
async def server(kind: str = "qwen"):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, info=info(kind))
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: MediaTokenizer()
        )
        yield create_app(handles).test_client(), worker
        nursery.cancel_scope.cancel()


def wav(seconds: float, rate: int = 16_000, channels: int = 1, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal((int(seconds * rate), channels)) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buf.getvalue()


def mp3(seconds: float, rate: int = 22_050) -> bytes:
    import av

    buf = io.BytesIO()
    samples = (np.sin(np.arange(int(seconds * rate)) * 0.05) * 8000).astype(np.int16)
    with av.open(buf, mode="w", format="mp3") as out:
        stream: Any = out.add_stream("libmp3lame", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def runs_of(prompt: Sequence[int], pad: int) -> list[int]:
    runs: list[int] = []
    previous = None
    for t in prompt:
        if t == pad:
            if previous == pad:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


def chat_body(*parts: dict[str, Any], text: str = "what is this?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 2}
