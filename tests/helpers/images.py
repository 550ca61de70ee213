"""Image requests against a fake vision model, for the image tests."""

from __future__ import annotations

import base64
import io
import json
import zlib
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio
from PIL import Image

from actors.options import options as serve_options
from actors.root import start_actors
from actors.worker_api import ModelInfo
from api.app import create_app
from model.vision.preprocess import ImageProcessorConfig
from tests.fakes import EOS, FakeTokenizer, FakeWorker

IMAGE_TOKEN = 999


PAD = "<|image_pad|>"


CONFIG = ImageProcessorConfig(max_pixels=28 * 28 * 64)


class VisionTokenizer(FakeTokenizer):
    """The placeholder's `<|image_pad|>` is one special token, as a Qwen2-VL tokenizer has it."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(text.split(PAD)):
            out += ([IMAGE_TOKEN] if i else []) + super().encode(piece)
        return out


def info(vision: bool) -> ModelInfo:
    extra: dict[str, Any] = {"vision": True, "image_token_id": IMAGE_TOKEN, "image_processor": CONFIG}
    return ModelInfo(
        name="fake-vlm",
        context_length=4096,
        weights_bytes=1_000_000,
        kv_bytes_per_token=1000,
        eos_token_ids=frozenset({EOS}),
        memory_bytes=10**12,
        **(extra if vision else {}),
    )


@asynccontextmanager
async def server(vision: bool = True):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1, info=info(vision))
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: VisionTokenizer()
        )
        yield create_app(handles).test_client(), worker
        nursery.cancel_scope.cancel()


def png(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def huge_png(side: int = 20000) -> bytes:
    """A valid PNG header for a side x side image whose (all-zero) data compresses to a few kB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = side.to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])  # 8-bit greyscale
    compressor = zlib.compressobj(9)
    row = b"\0" * (side + 1)
    data = b"".join(compressor.compress(row) for _ in range(64)) + compressor.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{b64(data)}"


def openai_body(*urls: str, text: str = "what is this?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 2}


def anthropic_body(*images: bytes, source: dict[str, Any] | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {"type": "image", "source": source or {"type": "base64", "media_type": "image/png", "data": b64(i)}}
        for i in images
    ]
    content = [*blocks, {"type": "text", "text": "describe"}]
    return {"model": "fake-vlm", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def responses_body(*urls: str) -> dict[str, Any]:
    parts = [{"type": "input_image", "image_url": u} for u in urls]
    return {
        "input": [{"role": "user", "content": [*parts, {"type": "input_text", "text": "hi"}]}],
        "max_output_tokens": 2,
    }


async def post(client, path: str, body: dict[str, Any]):
    return await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})


def png_header(width: int, height: int, *, color_type: int = 2, data: bytes = b"not deflate data") -> bytes:
    """A PNG whose header says width x height (8-bit, RGB by default) and whose pixel data is junk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, color_type, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
