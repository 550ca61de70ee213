"""Image parts on a vision model (api/images.py) over the real actors and a FakeWorker: OpenAI
`image_url`, Anthropic `image` and Responses `input_image` data reach the row as preprocessed
images with the prompt's pad token grown to each image's grid; bad images, URLs to fetch and too
many images are 400s in each protocol's envelope; a text-only model answers as it always has."""

from __future__ import annotations

import numpy as np
import pytest

from api.images import MAX_IMAGES
from tests.helpers.images import (
    IMAGE_TOKEN,
    PAD,
    anthropic_body,
    data_url,
    huge_png,
    openai_body,
    png,
    post,
    responses_body,
    server,
)


def pad_runs(prompt: tuple[int, ...]) -> list[int]:
    runs: list[int] = []
    previous = None
    for t in prompt:
        if t == IMAGE_TOKEN:
            if previous == IMAGE_TOKEN:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


async def test_openai_image_parts_reach_the_row(autojump_clock):
    async with server() as (client, worker):
        response = await post(
            client, "/v1/chat/completions", openai_body(data_url(png(168, 224)), data_url(png(60, 100, 1), "image/png"))
        )
        assert response.status_code == 200, await response.get_json()
        (spec,) = worker.specs.values()
        assert [i.grid_thw for i in spec.images] == [(1, 12, 16), (1, 4, 8)]
        assert pad_runs(spec.prompt) == [48, 8]  # t*h*w / merge^2 tokens per image
        assert spec.images[0].digest != spec.images[1].digest and spec.images[0].pixels.dtype == np.float32


async def test_anthropic_and_responses_image_parts_reach_the_row(autojump_clock):
    async with server() as (client, worker):
        response = await post(client, "/v1/messages", anthropic_body(png(168, 224)))
        assert response.status_code == 200, await response.get_json()
        response = await post(client, "/v1/responses", responses_body(data_url(png(60, 100, 1), "image/jpeg")))
        # (declared jpeg, is png: the media type only gates the kinds taken; Pillow reads the bytes)
        assert response.status_code == 200, await response.get_json()
        first, second = worker.specs.values()
        assert pad_runs(first.prompt) == [48] and pad_runs(second.prompt) == [8]


async def test_the_same_image_has_the_same_digest_across_requests(autojump_clock):
    async with server() as (client, worker):
        for _ in range(2):
            assert (await post(client, "/v1/chat/completions", openai_body(data_url(png(60, 100))))).status_code == 200
        a, b = worker.specs.values()
        assert a.images[0].digest == b.images[0].digest and a.prompt == b.prompt


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'
BAD_URLS = [
    ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
    (data_url(b"definitely not a png"), "cannot decode image"),
    (data_url(SVG, "image/svg+xml"), "unsupported image type"),
    (data_url(SVG), "cannot decode image"),  # an SVG that claims to be a PNG
    (data_url(huge_png()), "pixels"),  # 20000x20000: refused from its header, never decoded
    ("https://example.com/cat.png", "not fetched"),
    ("http://example.com/cat.png", "no network requests"),
    ("file:///etc/passwd", "data: URL"),
    ("data:image/png,rawbytes", "base64"),
]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
async def test_bad_images_are_openai_400s(autojump_clock, url, message):
    async with server() as (client, worker):
        response = await post(client, "/v1/chat/completions", openai_body(url))
        body = await response.get_json()
        assert response.status_code == 400, body
        assert body["error"]["type"] == "invalid_request_error" and message in body["error"]["message"], body
        assert body["error"]["param"] == "messages"
        assert not worker.specs


async def test_bad_images_in_anthropic_and_responses_envelopes(autojump_clock):
    async with server() as (client, worker):
        response = await post(client, "/v1/messages", anthropic_body(b"corrupt"))
        body = await response.get_json()
        assert response.status_code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and "cannot decode" in body["error"]["message"]
        url = {"type": "url", "url": "https://example.com/a.png"}
        body = await (await post(client, "/v1/messages", anthropic_body(b"", source=url))).get_json()
        assert "not fetched" in body["error"]["message"], body
        response = await post(client, "/v1/responses", responses_body(data_url(huge_png())))
        body = await response.get_json()
        assert response.status_code == 400 and body["error"]["param"] == "input", body
        assert "pixels" in body["error"]["message"]
        assert not worker.specs


async def test_too_many_images_and_placeholder_text_are_400s(autojump_clock):
    async with server() as (client, worker):
        small = data_url(png(60, 100))
        body = await (await post(client, "/v1/chat/completions", openai_body(*[small] * (MAX_IMAGES + 1)))).get_json()
        assert f"at most {MAX_IMAGES} images" in body["error"]["message"], body
        # Message text holding the pad token itself: the counts disagree, a 400 (never a 500).
        response = await post(client, "/v1/chat/completions", openai_body(small, text=f"hi {PAD}"))
        assert response.status_code == 400
        assert "image placeholders" in (await response.get_json())["error"]["message"]
        assert not worker.specs


async def test_a_text_model_keeps_its_400(autojump_clock):
    async with server(vision=False) as (client, worker):
        for path, body in [
            ("/v1/chat/completions", openai_body(data_url(png(60, 100)))),
            ("/v1/messages", anthropic_body(png(60, 100))),
            ("/v1/responses", responses_body(data_url(png(60, 100)))),
        ]:
            response = await post(client, path, body)
            assert response.status_code == 400
            message = (await response.get_json())["error"]["message"]
            assert "image_url content parts are not supported" in message and "text-only model" in message
        models = await (await client.get("/v1/models")).get_json()
        assert models["data"][0]["vision"] is False and models["data"][0]["capabilities"]["vision"] is False
        assert not worker.specs


async def test_models_lists_vision(autojump_clock):
    async with server() as (client, _):
        models = await (await client.get("/v1/models")).get_json()
        assert models["data"][0]["vision"] is True and models["data"][0]["capabilities"]["vision"] is True


async def test_count_tokens_counts_each_images_grid(autojump_clock):
    async with server() as (client, _):
        body = anthropic_body(png(168, 224))
        del body["max_tokens"]
        with_image = (await (await post(client, "/v1/messages/count_tokens", body)).get_json())["input_tokens"]
        body["messages"][0]["content"] = [{"type": "text", "text": "describe"}]
        text_only = (await (await post(client, "/v1/messages/count_tokens", body)).get_json())["input_tokens"]
        assert with_image > text_only + 40  # 48 image tokens (and the placeholder's text)
