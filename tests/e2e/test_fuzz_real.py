"""Fuzz the body-reading routes against the REAL engine (tiny model, real server): no 5xx.

The bodies are tests/api/test_fuzz.py's (malformed, hostile and plausible-but-odd), sent to
/v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens and /v1/responses
of a real server (real GPU worker thread, scheduler, admission, app), and every answer is checked
the same way: never a 5xx, always the route's own shape. 5 routes x EXAMPLES x 20 bodies = 5,000.
Generations stay short (the server's default max_tokens is small and larger requests are cut
down) so the run is about the input path, not decoding.

Real threads: the real clock, a generous `trio.fail_after` per body.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from hypothesis import given, settings

from tests.helpers.fuzz import (
    COUNT,
    FUZZ,
    MESSAGES,
    PREV,
    RESPONSES,
    batches,
    chat_object,
    check_answer,
    count_object,
    messages_object,
    responses_object,
    text_object,
)
from tests.realserver import CHAT, COMPLETIONS, real_server

pytestmark = pytest.mark.slow

EXAMPLES = 20  # x 20 bodies x 5 routes = 2,000 bodies
MAX_TOKENS = 3
LIMIT_S = 60.0
LENGTH_FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def short(data: bytes) -> bytes:
    """The body with any valid length field above MAX_TOKENS cut to it (others untouched)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: sent as it is
        return data
    if not isinstance(body, dict):
        return data
    changed = False
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value < 2**31:
            body[name] = MAX_TOKENS
            changed = True
    return json.dumps(body).encode() if changed else data


def without_logprobs(raw: bytes, content_type: str) -> bytes:
    """A JSON completion, or each chunk of an SSE stream, with its `logprobs` blocks nulled: chat's
    are mlx_lm.server's shape, on purpose not OpenAI's (api/openai/encode.py), so the SDK models
    cannot validate them."""
    if content_type == "text/event-stream":
        frames = raw.decode().split("\n\n")
        for i, frame in enumerate(frames):
            if frame.startswith("data: {"):
                frames[i] = "data: " + _nulled(frame.removeprefix("data: "))
        return "\n\n".join(frames).encode()
    if content_type != "application/json":
        return raw
    return _nulled(raw.decode()).encode()


def _nulled(text: str) -> str:
    body = json.loads(text)
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return text
    for choice in body["choices"]:
        if isinstance(choice, dict) and choice.get("logprobs") is not None:
            choice["logprobs"] = None
    return json.dumps(body)


async def post(client: Any, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    """POST, reading the answer as it comes (the test client holds only a few chunks before the
    app blocks, and a real stream has many): status, content type, body."""
    raw = b""
    async with client.request(path, method="POST", headers=headers) as conn:
        await conn.send(data)
        await conn.send_complete()
        while True:
            try:
                raw += await conn.receive()
            except trio.EndOfChannel:
                break
        assert conn.status_code is not None and conn.headers is not None
        return conn.status_code, conn.headers.get("Content-Type", ""), raw


def send_all(model_dir: Any, path: str, bodies: list[tuple[str, bytes]]) -> None:
    async def main() -> None:
        async with real_server(model_dir, max_tokens=MAX_TOKENS) as server:
            previous = "resp_none_yet"
            for content_type, data in bodies:
                data = short(data.replace(PREV.encode(), previous.encode()))
                headers = {"Content-Type": content_type} if content_type else {}
                with trio.fail_after(LIMIT_S):
                    status, answer_type, raw = await post(server.client, path, data, headers)
                try:
                    new_id = check_answer(path, status, answer_type, without_logprobs(raw, answer_type))
                except Exception as exc:
                    raise AssertionError(
                        f"POST {path} {content_type!r} {data[:2000]!r}\n-> {status} {raw[:2000]!r}"
                    ) from exc
                previous = new_id or previous
            with trio.fail_after(LIMIT_S):
                while server.handles.scheduler.active_rows or server.handles.admission.in_flight:
                    await trio.sleep(0.01)

    trio.run(main)


@settings(FUZZ, max_examples=EXAMPLES)
@given(bodies=batches(chat_object))
def test_fuzz_real_chat_completions(model_dir, bodies):
    send_all(model_dir, CHAT, bodies)


@settings(FUZZ, max_examples=EXAMPLES)
@given(bodies=batches(text_object))
def test_fuzz_real_completions(model_dir, bodies):
    send_all(model_dir, COMPLETIONS, bodies)


@settings(FUZZ, max_examples=EXAMPLES)
@given(bodies=batches(messages_object))
def test_fuzz_real_anthropic_messages(model_dir, bodies):
    send_all(model_dir, MESSAGES, bodies)


@settings(FUZZ, max_examples=EXAMPLES)
@given(bodies=batches(count_object))
def test_fuzz_real_anthropic_count_tokens(model_dir, bodies):
    send_all(model_dir, COUNT, bodies)


@settings(FUZZ, max_examples=EXAMPLES)
@given(bodies=batches(responses_object))
def test_fuzz_real_responses(model_dir, bodies):
    send_all(model_dir, RESPONSES, bodies)


@pytest.fixture(scope="module", params=["qwen3_5", "gemma4"])
def media_dir(request, tmp_path_factory):
    """A tiny checkpoint with its towers: Qwen3.5 (images, video), Gemma 4 (images, audio)."""
    from tests.fixtures.vlm import write_gemma4_dir, write_qwen3_5_vl_dir

    write = write_qwen3_5_vl_dir if request.param == "qwen3_5" else write_gemma4_dir
    return write(tmp_path_factory.mktemp(f"fuzz_{request.param}") / request.param)


@settings(FUZZ, max_examples=EXAMPLES // 4)
@given(bodies=batches(chat_object))
def test_fuzz_real_media_chat_completions(media_dir, bodies):
    """Image, video and audio parts (valid, corrupt, of kinds the model does not take) reach the
    real towers, or are 400s: never a 5xx."""
    send_all(media_dir, CHAT, bodies)
