"""Video and audio parts (api/images.py) over the real actors and a FakeWorker: OpenAI `video_url`
(a container, or vLLM's base64 frames), Qwen's `video` frame lists, OpenAI and Responses
`input_audio` reach the row as preprocessed items with each placeholder grown into its runs
(timestamps before a video's frame pairs; a model's own placeholder tokens); bad media, media a
model does not take, and Anthropic audio blocks are 400s in each protocol's envelope; /v1/models
says video and audio."""

from __future__ import annotations

from fractions import Fraction

import pytest

from api.images import MAX_AUDIO_SECONDS, MAX_IMAGES
from tests.fakes import FakeTokenizer
from tests.helpers.images import data_url, png, post
from tests.helpers.media import encode_video, noise_frames
from tests.helpers.media_api import (
    AUDIO,
    BOA,
    EOA,
    VE,
    VIDEO,
    VS,
    chat_body,
    mp3,
    runs_of,
    server,
    wav,
)

pytest.importorskip("av", reason="PyAV decodes video and MP3")

VIDEO_BYTES = encode_video(noise_frames(25), fps=10)  # 2.5 s: 5 frames at 2 fps, 3 frame pairs


def video_part(data: bytes = VIDEO_BYTES, media: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, media)}}


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    import base64

    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


async def error_of(client, path: str, body: dict) -> dict:
    response = await post(client, path, body)
    assert response.status_code == 400, await response.get_json()
    return await response.get_json()


async def test_a_video_reaches_the_row_with_timestamped_frame_pairs(autojump_clock):
    async with server("qwen") as (client, worker):
        response = await post(client, "/v1/chat/completions", chat_body(video_part()))
        assert response.status_code == 200, await response.get_json()
        (spec,) = worker.specs.values()
        (item,) = spec.images
        assert item.kind == "video" and item.grid_thw == (3, 6, 8) and item.runs == (12, 12, 12)
        assert runs_of(spec.prompt, VIDEO) == [12, 12, 12]
        tokenizer = FakeTokenizer()
        expected: list[int] = []
        for seconds in ("0.3", "1.5", "2.4"):  # each frame pair's mean time, as Qwen3-VL's processor
            expected += tokenizer.encode(f"<{seconds} seconds>") + [VS] + [VIDEO] * 12 + [VE]
        prompt = list(spec.prompt)
        start = prompt.index(VIDEO) - 1 - len(tokenizer.encode("<0.3 seconds>"))
        assert prompt[start : start + len(expected)] == expected


async def test_frames_lists_reach_the_row(autojump_clock):
    frames = [png(64, 96, seed) for seed in range(3)]
    vllm = {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(_b64(f) for f in frames)}}
    qwen = {"type": "video", "video": [data_url(f) for f in frames]}
    async with server("qwen") as (client, worker):
        for part in (vllm, qwen):
            response = await post(client, "/v1/chat/completions", chat_body(part))
            assert response.status_code == 200, await response.get_json()
        first, second = worker.specs.values()
        assert first.images[0].grid_thw == second.images[0].grid_thw == (2, 4, 6)  # 3 frames, the last repeated
        assert first.images[0].digest == second.images[0].digest and runs_of(first.prompt, VIDEO) == [6, 6]


async def test_audio_reaches_the_row_with_the_models_own_placeholders(autojump_clock):
    async with server("gemma") as (client, worker):
        response = await post(client, "/v1/chat/completions", chat_body(audio_part(wav(1.0))))
        assert response.status_code == 200, await response.get_json()
        response = await post(client, "/v1/chat/completions", chat_body(audio_part(mp3(2.0), "mp3")))
        assert response.status_code == 200, await response.get_json()
        body = {
            "input": [{"role": "user", "content": [audio_part(wav(0.5, rate=44_100, channels=2))]}],
            "max_output_tokens": 2,
        }
        response = await post(client, "/v1/responses", body)
        assert response.status_code == 200, await response.get_json()
        one, two, three = worker.specs.values()
        assert [s.images[0].runs for s in (one, two, three)] == [(25,), (50,), (13,)]  # a token per 40 ms
        assert one.images[0].pixels.shape == (99, 128)  # log-mel frames
        prompt = list(one.prompt)
        at = prompt.index(AUDIO)
        assert prompt[at - 1] == BOA and prompt[at : at + 26] == [AUDIO] * 25 + [EOA]


BAD_VIDEOS = [
    (video_part(b"not a video at all"), "cannot decode video"),
    (video_part(VIDEO_BYTES, "video/x-flv"), "unsupported video type"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "not fetched"),
    ({"type": "video", "video": []}, "non-empty array"),
    ({"type": "video", "video": [data_url(png(64, 96)), data_url(png(32, 48))]}, "share one size"),
    ({"type": "video", "video": [data_url(png(64, 96))] * 13}, "at most 12"),
    (video_part(encode_video(noise_frames(3, 16, 16), fps=10)), "at least 32 pixels"),
]


@pytest.mark.parametrize(("part", "message"), BAD_VIDEOS)
async def test_bad_videos_are_400s(autojump_clock, part, message):
    async with server("qwen") as (client, worker):
        body = await error_of(client, "/v1/chat/completions", chat_body(part))
        assert message in body["error"]["message"] and body["error"]["param"] == "messages", body
        assert not worker.specs


async def test_a_video_over_its_length_is_a_400(autojump_clock):
    long = encode_video(noise_frames(62, 32, 32), fps=Fraction(1, 10))  # 620 s
    async with server("qwen") as (client, worker):
        body = await error_of(client, "/v1/chat/completions", chat_body(video_part(long)))
        assert "at most 600 s" in body["error"]["message"], body


BAD_AUDIO = [
    (audio_part(b"RIFF....WAVEjunk"), "cannot decode audio"),
    (audio_part(wav(1.0), "flac"), "unsupported audio format"),
    (audio_part(b"\xff\xfb\x90\x00" + b"\x00" * 64, "mp3"), "cannot decode audio"),
    (audio_part(wav(MAX_AUDIO_SECONDS + 1)), f"at most {MAX_AUDIO_SECONDS:.0f} s"),
    ({"type": "input_audio", "input_audio": "not an object"}, "input_audio must be"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "comes as an input_audio part"),
]


@pytest.mark.parametrize(("part", "message"), BAD_AUDIO)
async def test_bad_audio_is_a_400(autojump_clock, part, message):
    async with server("gemma") as (client, worker):
        body = await error_of(client, "/v1/chat/completions", chat_body(part))
        assert message in body["error"]["message"], body
        assert not worker.specs


async def test_bad_audio_in_the_responses_envelope(autojump_clock):
    async with server("gemma") as (client, worker):
        body = {"input": [{"role": "user", "content": [audio_part(b"junk", "mp3")]}], "max_output_tokens": 2}
        error = (await error_of(client, "/v1/responses", body))["error"]
        assert "cannot decode audio" in error["message"] and error["param"] == "input", error
        assert not worker.specs


async def test_kinds_a_model_does_not_take_are_400s(autojump_clock):
    async with server("qwen") as (client, _):
        body = await error_of(client, "/v1/chat/completions", chat_body(audio_part(wav(1.0))))
        assert "takes no audio input" in body["error"]["message"], body
    async with server("gemma") as (client, _):
        body = await error_of(client, "/v1/chat/completions", chat_body(video_part()))
        assert "takes no video input" in body["error"]["message"], body
        items = [audio_part(wav(0.2))] * (MAX_IMAGES + 1)
        body = await error_of(client, "/v1/chat/completions", chat_body(*items))
        assert f"at most {MAX_IMAGES}" in body["error"]["message"], body
    async with server("text") as (client, worker):
        for part in (video_part(), audio_part(wav(1.0))):
            body = await error_of(client, "/v1/chat/completions", chat_body(part))
            assert "text-only model" in body["error"]["message"], body
        body = {"input": [{"role": "user", "content": [audio_part(wav(1.0))]}], "max_output_tokens": 2}
        assert "text-only model" in (await error_of(client, "/v1/responses", body))["error"]["message"]
        assert not worker.specs


async def test_anthropic_has_no_audio_or_video_blocks(autojump_clock):
    async with server("gemma") as (client, worker):
        for block in ({"type": "audio", "source": {}}, {"type": "video", "source": {}}):
            body = {"model": "fake-gemma", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
            error = await error_of(client, "/v1/messages", body)
            assert error["type"] == "error" and "/v1/chat/completions" in error["error"]["message"], error
        assert not worker.specs


async def test_models_says_video_and_audio(autojump_clock):
    for kind, video, audio in (("qwen", True, False), ("gemma", False, True), ("text", False, False)):
        async with server(kind) as (client, _):
            card = (await (await client.get("/v1/models")).get_json())["data"][0]
            assert (card["video"], card["audio"]) == (video, audio)
            assert (card["capabilities"]["video"], card["capabilities"]["audio"]) == (video, audio)


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()
