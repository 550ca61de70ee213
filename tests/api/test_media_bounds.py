"""Media bounds before decoding (api/images.py `plan_images`, api/media.py), over the real actors
and a FakeWorker. The refusals use images whose pixel data is junk: decoding one would answer
"cannot decode", so an answer naming the limit shows the header alone decided. Each refusal is a
400 in its protocol's envelope. Requests beyond the total media memory wait their turn and all
answer; a plain chat never waits on image work; count_tokens reads headers only."""

from __future__ import annotations

import io
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from PIL import Image

from actors.handles import ServerHandles
from actors.options import options as serve_options
from actors.root import start_actors
from api import media
from api.app import create_app
from api.http import offload
from api.images import MAX_FRAMES, MAX_SOURCE_PIXELS
from tests.fakes import FakeWorker
from tests.helpers.images import (
    VisionTokenizer,
    anthropic_body,
    data_url,
    info,
    openai_body,
    png,
    png_header,
    post,
    responses_body,
)
from tests.helpers.options import parsed

CHAT = "/v1/chat/completions"
GIB = 1 << 30


@attrs.frozen
class Server:
    client: Any
    worker: FakeWorker
    handles: ServerHandles


@asynccontextmanager
async def server(*, context_length: int = 8192, **config: Any) -> AsyncIterator[Server]:
    """Its fake worker's costs are short: tests that wait on real threads run on the real clock
    (a mock clock would jump past their deadlines while a thread works)."""
    model = attrs.evolve(info(True), context_length=context_length)
    worker = FakeWorker(chunk=1024, prefill_cost=0.01, join_cost=0.01, step_cost=0.01, info=model)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: VisionTokenizer()
        )
        yield Server(create_app(handles).test_client(), worker, handles)
        nursery.cancel_scope.cancel()


async def refusal(client: Any, path: str, body: dict[str, Any]) -> str:
    """The 400's message, checked to be in the path's envelope."""
    response = await post(client, path, body)
    answer = await response.get_json()
    assert response.status_code == 400, answer
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    else:
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"], answer
    return str(answer["error"]["message"])


def bodies(data: bytes, count: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """The same images as an OpenAI, an Anthropic and a Responses request."""
    url = data_url(data)
    return [
        (CHAT, openai_body(*[url] * count)),
        ("/v1/messages", anthropic_body(*[data] * count)),
        ("/v1/responses", responses_body(*[url] * count)),
    ]


async def test_a_prompt_whose_images_cannot_fit_is_refused_undecoded(autojump_clock):
    # 8 images of 64 tokens each (the fake model's max_pixels) cannot fit a 300-token window.
    async with server(context_length=300) as s:
        for path, body in bodies(png_header(8192, 8192), count=8):
            message = await refusal(s.client, path, body)
            assert "prompt is too long" in message and "300" in message, message
        # The same prompt with one image fits, and only then is the junk decoded.
        message = await refusal(s.client, CHAT, openai_body(data_url(png_header(8192, 8192))))
        assert "cannot decode" in message
        assert not s.worker.specs
        assert (await post(s.client, CHAT, openai_body(data_url(png(168, 224))))).status_code == 200


@pytest.mark.parametrize("action", ["default", "error"])
async def test_pixels_and_decompression_bombs_are_400s_naming_the_limit(autojump_clock, action):
    with warnings.catch_warnings():
        warnings.simplefilter(action)  # Pillow's warning between 89.5 and 179 Mpx, raised or not
        async with server() as s:
            for side in (8193, 10_000, 20_000):
                for path, body in bodies(png_header(side, side)):
                    assert f"over {MAX_SOURCE_PIXELS} pixels" in await refusal(s.client, path, body)
            assert not s.worker.specs


async def test_too_many_frames_is_a_400(autojump_clock):
    shots = [Image.new("RGB", (1, 1), (i % 256, i // 256, 0)) for i in range(MAX_FRAMES + 1)]
    buf = io.BytesIO()
    shots[0].save(buf, format="GIF", save_all=True, append_images=shots[1:])
    async with server() as s:
        for path, body in bodies(buf.getvalue()):
            assert f"more than {MAX_FRAMES} frames" in await refusal(s.client, path, body)
        assert not s.worker.specs


async def test_other_formats_and_corrupt_data_are_400s(autojump_clock):
    bmp = io.BytesIO()
    Image.new("RGB", (40, 40)).save(bmp, format="BMP")
    good = png(64, 64)
    async with server() as s:
        for path, body in bodies(bmp.getvalue()):  # Pillow reads BMP; the API takes four formats
            assert "not a PNG, JPEG, WebP or GIF" in await refusal(s.client, path, body)
        for path, body in bodies(good[: len(good) // 2]):  # a good header, truncated data
            assert "image 1: cannot decode image" in await refusal(s.client, path, body)
        assert not s.worker.specs
        # The ledger is back to empty after every refusal.
        assert media.memory(s.handles).used == 0


async def test_a_request_over_the_per_request_memory_cap_is_a_400(autojump_clock):
    # A 2048x2048 PNG bills about 40 MiB to decode; the cap is 16 MiB.
    big = Image.new("RGB", (2048, 2048), (10, 20, 30))
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    async with server(media_request_memory_gb=16 / 1024) as s:
        for path, body in bodies(buf.getvalue()):
            message = await refusal(s.client, path, body)
            assert "over this server's limit of 16 MiB per request" in message, message
        assert not s.worker.specs
        assert (await post(s.client, CHAT, openai_body(data_url(png(168, 224))))).status_code == 200


async def test_the_per_request_cap_never_exceeds_the_total():
    config = serve_options(media_memory_gb=1, media_request_memory_gb=3).admission
    assert media.request_limit(config) == media.total_bytes(config) == GIB


async def test_image_requests_beyond_the_total_wait_and_all_answer():
    async with server() as s:
        ledger = media.memory(s.handles)
        answers: list[int] = []

        async def send(i: int) -> None:
            response = await post(s.client, CHAT, openai_body(data_url(png(168, 224, seed=i))))
            answers.append(response.status_code)

        async with trio.open_nursery() as nursery:
            async with ledger.hold(ledger.capacity):  # all the media memory taken
                for i in range(3):
                    nursery.start_soon(send, i)
                with trio.fail_after(30):
                    while ledger.waiting < 3:  # every request queued for memory, none refused
                        await trio.sleep(0.01)
                assert not answers and not s.worker.specs
                # A plain chat does not wait for media memory.
                plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert (await post(s.client, CHAT, plain)).status_code == 200
            # (memory freed: the queued requests decode and answer)
        assert answers == [200, 200, 200] and len(s.worker.specs) == 4
        assert ledger.used == 0 and ledger.waiting == 0


async def test_a_plain_chat_never_waits_for_the_media_threads():
    async with server() as s:
        answers: list[int] = []

        async def send_image() -> None:
            answers.append((await post(s.client, CHAT, openai_body(data_url(png(168, 224))))).status_code)

        media_threads = media.limiter()
        async with trio.open_nursery() as nursery:
            tokens = [object() for _ in range(int(media_threads.total_tokens))]
            for token in tokens:  # every media thread busy
                await media_threads.acquire_on_behalf_of(token)
            nursery.start_soon(send_image)
            with trio.fail_after(30):
                while media_threads.statistics().tasks_waiting == 0:  # the image waits to decode
                    await trio.sleep(0.01)
            # A plain chat large enough to take the shared threads answers meanwhile.
            body = {"messages": [{"role": "user", "content": "y" * 5000}], "max_tokens": 2}
            assert len(str(body)) > offload.INLINE_BYTES
            with trio.fail_after(30):
                assert (await post(s.client, CHAT, body)).status_code == 200
            assert not answers
            for token in tokens:
                media_threads.release_on_behalf_of(token)
        assert answers == [200]


async def test_count_tokens_reads_headers_only(autojump_clock):
    async with server() as s:
        counts = []
        for data in (png(168, 224), png_header(224, 168)):  # the second's pixel data is junk
            body = anthropic_body(data)
            del body["max_tokens"]
            response = await post(s.client, "/v1/messages/count_tokens", body)
            assert response.status_code == 200, await response.get_json()
            counts.append((await response.get_json())["input_tokens"])
        assert counts[0] == counts[1]
        body = anthropic_body(png_header(20_000, 20_000))
        del body["max_tokens"]
        assert "pixels" in await refusal(s.client, "/v1/messages/count_tokens", body)


def test_the_flags_fill_the_options():

    config = parsed(["--media-memory", "2", "--media-request-memory", "0.5"])
    assert (config.media_memory_gb, config.media_request_memory_gb) == (2.0, 0.5)
    admission = serve_options(media_memory_gb=2.0, media_request_memory_gb=0.5).admission
    assert media.request_limit(admission) == GIB // 2 and media.total_bytes(admission) == 2 * GIB
    with pytest.raises(SystemExit):
        parsed(["--media-memory", "0"])
