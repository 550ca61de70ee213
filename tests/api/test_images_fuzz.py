"""Image parts in the fuzz run: random mixes of good and bad images (valid PNG/JPEG of random
sizes, corrupt base64, SVG, non-images under an image type, a 20000x20000 PNG header, http URLs,
junk sources) on the three protocols of a vision model. Every answer is a 200 or a 400 in the
protocol's envelope, never a 500, and the server ends with no row left behind."""

from __future__ import annotations

import io

import numpy as np
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image
from trio.testing import MockClock

from tests.helpers.images import anthropic_body, b64, data_url, huge_png, openai_body, post, responses_body, server

SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'


def image_bytes(kind: str, height: int, width: int, seed: int) -> tuple[bytes, str]:
    if kind == "huge":
        return huge_png(), "image/png"
    if kind == "svg":
        return SVG, "image/svg+xml"
    if kind == "text":
        return b"not an image at all", "image/png"
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    fmt = {"png": "PNG", "jpeg": "JPEG"}[kind]
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue(), f"image/{kind}"


an_image = st.builds(
    image_bytes,
    st.sampled_from(["png", "png", "jpeg", "huge", "svg", "text"]),
    st.integers(1, 90),
    st.integers(1, 90),
    st.integers(0, 9),
)
a_url = st.one_of(
    an_image.map(lambda im: data_url(*im)),
    st.just("data:image/png;base64,@@@not-base64@@@"),
    st.just("http://example.com/cat.png"),
    st.just("https://example.com/cat.png"),
    st.text(max_size=20),
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict]:
    n = draw(st.integers(0, 10))  # past the 8-image cap sometimes
    protocol = draw(st.sampled_from(["openai", "anthropic", "responses"]))
    if protocol == "openai":
        return "/v1/chat/completions", openai_body(*draw(st.lists(a_url, min_size=n, max_size=n)))
    if protocol == "responses":
        return "/v1/responses", responses_body(*draw(st.lists(a_url, min_size=n, max_size=n)))
    images = draw(st.lists(an_image, min_size=n, max_size=n))
    body = anthropic_body(*(data for data, _ in images))
    for block, (_, media) in zip(body["messages"][0]["content"], images):
        block["source"]["media_type"] = media
    if images and draw(st.booleans()):  # a junk source on the first block
        body["messages"][0]["content"][0]["source"] = draw(
            st.sampled_from([{"type": "url", "url": "http://x/y.png"}, {"type": "base64"}, {"data": b64(b"x")}, "x"])
        )
    return "/v1/messages", body


@settings(
    max_examples=3,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(bodies(), min_size=12, max_size=12))
def test_random_image_mixes_answer_200_or_400_and_leave_nothing_behind(batch):
    async def main() -> None:
        async with server() as (client, worker):
            for path, body in batch:
                response = await post(client, path, body)
                answer = await response.get_json()
                assert response.status_code in (200, 400), (path, response.status_code, answer)
                if response.status_code == 400:  # the protocol's own error envelope
                    assert answer["type" if path == "/v1/messages" else "error"]
            await trio.sleep(1)
            ok = await post(client, "/v1/chat/completions", openai_body())  # a neighbour is unaffected
            assert ok.status_code == 200

    # Virtual time: the fake worker's costs cost nothing; image decoding still runs on real threads.
    trio.run(main, clock=MockClock(autojump_threshold=0))
