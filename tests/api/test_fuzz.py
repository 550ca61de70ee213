"""Fuzz every body-reading route with hypothesis, on a FakeWorker.

Routes: /v1/chat/completions, /v1/completions (OpenAI), /v1/messages, /v1/messages/count_tokens
(Anthropic), /v1/responses (OpenAI Responses) and /admin/cache/flush. Bodies are malformed and
adversarial — raw bytes, JSON cut short, invalid UTF-8 spliced into valid JSON, lone surrogates,
NaN / 1e400 / 5,000-digit integers, wrong types at every known field, missing fields, nested
junk, non-object JSON, odd Content-Types — and also plausible-but-odd valid-shaped bodies, most of
which reach the engine. Every call runs under a virtual-time `fail_after` (a deadlock fails
fast), must never answer 5xx, and must answer in THAT route's API:

* OpenAI (chat, completions, admin): `{"error": {"message", "type", "param", "code"}}`, or a
  completion object / an SSE stream ending in `[DONE]`;
* Anthropic: `{"type": "error", "error": {"type", "message"}}` (type matching the status), or a
  `message` object / a native event stream (message_start ... message_stop), validated by the
  anthropic SDK's pydantic models; count_tokens: `{"input_tokens": n}`;
* Responses: OpenAI's envelope with type `invalid_request_error` (api/errors.py's
  `responses_error_body`), or a Response object / its event stream (sequence numbers 0.., ending in
  response.completed or response.incomplete), validated by the openai SDK's models.

Afterwards each server is back at baseline (nothing in flight, no rows, no worker protocol
violation).

Each hypothesis example is a batch of BODIES_PER_EXAMPLE bodies sent to one fresh server (a
server per body would spend the run on start-up). `MLX_TRIO_FUZZ_EXAMPLES` (examples per route)
scales it: the default 4 is 4 x 20 x 6 routes = 480 bodies (~30 s on 2 shared cores);
MLX_TRIO_FUZZ_EXAMPLES=42 is 5,040.
"""

from __future__ import annotations

import json
import re
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio.testing import MockClock

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.http import offload
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.fuzz import (
    CHAT,
    COUNT,
    FLUSH,
    FUZZ,
    MESSAGES,
    PREV,
    RAW,
    RESPONSES,
    TEXT,
    batches,
    chat_object,
    check_answer,
    count_object,
    json_value,
    messages_object,
    raw_bytes,
    responses_object,
    text_object,
)
from tests.helpers.media_api import MediaTokenizer
from tests.helpers.media_api import info as media_info

CONTEXT = 256  # a small context caps every generation (max_tokens is clamped to it)
VIRTUAL_LIMIT_S = 3600.0
REAL_LIMIT_S = 60.0


# --- raw fragments ---------------------------------------------------------------------------------
# Values json.dumps cannot write: a placeholder string in the object, swapped for the raw bytes
# after encoding.


# --- strategies ----------------------------------------------------------------------------------


# OpenAI chat / completions


# Anthropic Messages / count_tokens


# OpenAI Responses


# /admin/cache/flush reads no body: anything at all must still get the flush result.
flush_object = st.one_of(st.just({}), st.dictionaries(st.text(max_size=8), json_value, max_size=4))


# --- checking answers ------------------------------------------------------------------------------


# --- the run -------------------------------------------------------------------------------------


@asynccontextmanager
async def server(media: str | None = None):
    """A text model, or a fake media one (tests/helpers/media_api.py: "qwen" or "gemma")."""
    cost = 0.0 if media else 0.01  # (a media model's run is on the real clock: no time to spend)
    worker = FakeWorker(prefill_cost=cost, join_cost=cost, step_cost=cost, info=media_info(media) if media else None)
    worker.info = attrs.evolve(worker.info, context_length=CONTEXT)
    tokenizer = MediaTokenizer if media else FakeTokenizer
    async with trio.open_nursery() as nursery:
        handles = await start_actors(nursery, worker, options=serve_options(), make_tokenizer=lambda info: tokenizer())
        yield create_app(handles).test_client(), handles, worker
        nursery.cancel_scope.cancel()


async def post(client, path: str, data: bytes, content_type: str = "application/json"):
    """POST, draining the body as it comes (the test client's `post` holds only 10 chunks, so a
    long stream through it would deadlock)."""
    headers = {"Content-Type": content_type} if content_type else {}
    async with client.request(path, method="POST", headers=headers) as conn:
        await conn.send(data)
        await conn.send_complete()
        return await conn.as_response()


def send_all(path: str, bodies: list[tuple[str, bytes]], media: str | None = None) -> list[int]:
    """Every body to one fresh server (a media model's: `media`), in order; the statuses."""
    statuses: list[int] = []

    async def main() -> None:
        async with server(media) as (client, handles, worker):
            previous = "resp_none_yet"
            for content_type, data in bodies:
                data = data.replace(PREV.encode(), previous.encode())
                with trio.fail_after(limit):  # a hang fails here
                    response = await post(client, path, data, content_type)
                    raw = await response.get_data()
                try:
                    new_id = check_answer(path, response.status_code, response.content_type or "", raw)
                except Exception as exc:
                    raise AssertionError(
                        f"POST {path} {content_type!r} {data[:2000]!r}\n-> {response.status_code} {raw[:2000]!r}"
                    ) from exc
                previous = new_id or previous
                statuses.append(response.status_code)
            if not real_time:
                await trio.sleep(1)  # let aborted / finished rows leave at their step boundary
            assert handles.admission.in_flight == 0
            assert handles.scheduler.active_rows == 0 and not handles.scheduler.table.queue
            assert not worker.violations, worker.violations

    # A body over offload.INLINE_BYTES is parsed and prepared on a worker thread, and an autojump
    # clock jumps while a thread runs (every task is blocked), straight to the fail_after
    # deadline: such batches run on the real clock; everything else in virtual time.
    real_time = media is not None or any(len(data) > offload.INLINE_BYTES for _, data in bodies)
    limit = REAL_LIMIT_S if real_time else VIRTUAL_LIMIT_S
    trio.run(main, clock=None if real_time else MockClock(autojump_threshold=0))
    return statuses


@FUZZ
@given(batches(chat_object))
@pytest.mark.slow
def test_fuzz_chat_completions(bodies):
    send_all(CHAT, bodies)


@FUZZ
@given(batches(text_object))
@pytest.mark.slow
def test_fuzz_completions(bodies):
    send_all(TEXT, bodies)


@FUZZ
@given(batches(messages_object))
@pytest.mark.slow
def test_fuzz_anthropic_messages(bodies):
    send_all(MESSAGES, bodies)


@FUZZ
@given(batches(count_object))
def test_fuzz_anthropic_count_tokens(bodies):
    send_all(COUNT, bodies)


@FUZZ
@given(batches(responses_object))
@pytest.mark.slow
def test_fuzz_responses(bodies):
    send_all(RESPONSES, bodies)


@FUZZ
@given(batches(chat_object))
@pytest.mark.slow
@pytest.mark.parametrize("media", ["qwen", "gemma"])
def test_fuzz_chat_completions_on_media_models(media, bodies):
    """Image, video and audio parts (valid, corrupt, of kinds the model does not take) on models
    that take media: decoded on real threads, so on the real clock."""
    send_all(CHAT, bodies, media)


@FUZZ
@given(batches(responses_object))
@pytest.mark.slow
def test_fuzz_responses_on_a_media_model(bodies):
    send_all(RESPONSES, bodies, "gemma")


@FUZZ
@given(batches(flush_object))
def test_fuzz_admin_cache_flush(bodies):
    send_all(FLUSH, bodies)


HOSTILE = [
    b"\xff" * 10,
    b"[" * 50_000,
    b"{" * 50_000,
    b'{"max_tokens": 1e400}',
    b'{"prompt": "\\udc00"}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"input": "\xc3\x28"}',
    b'{"max_tokens": ' + b"9" * 5000 + b"}",
    b'{"messages": "' + b"x" * 100_000 + b'"}',
    json.dumps(
        {
            "messages": [{"role": "user", "content": "x"}],
            "prompt": "x",
            "input": "x",
            "max_tokens": 10**30,
            "max_output_tokens": 10**30,
            "seed": -(2**80),
            "stream": True,
        }
    ).encode(),
    json.dumps(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 50}],
            "input": "y" * 1000,
            "prompt": "y" * 1000,
            "stop": ["a"] * 100,
            "stop_sequences": ["a"] * 100,
            "max_tokens": 3,
        }
    ).encode(),
    # Unhashable values where a translator looks a string up in a set of known types.
    json.dumps(
        {
            "messages": [{"role": "user", "content": [{"type": ["text"]}, {"type": {"a": 1}}]}],
            "input": [{"type": "message", "role": ["user"], "content": [{"type": ["input_text"], "text": "x"}]}],
            "max_tokens": 3,
        }
    ).encode(),
    json.dumps(
        {
            "messages": [{"role": "user", "content": [{"type": "tool_result", "content": [{"type": []}]}]}],
            "input": [{"type": {}}],
            "max_tokens": 3,
        }
    ).encode(),
    json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "input": [{"role": {}, "content": "x"}], "max_tokens": 3}
    ).encode(),
]


@pytest.mark.parametrize("path", [CHAT, TEXT, MESSAGES, COUNT, RESPONSES, FLUSH])
def test_known_hostile_bodies(path):
    send_all(path, [("application/json", body) for body in HOSTILE])


def test_responses_continuation_chain_under_fuzzed_fields():
    """PREV really is replaced by a stored id: a continuation of a continuation succeeds."""
    first = json.dumps({"input": "hi", "max_output_tokens": 3}).encode()
    follow = json.dumps({"input": "again", "previous_response_id": PREV, "max_output_tokens": 3}).encode()
    statuses = send_all(
        RESPONSES, [("application/json", first), ("application/json", follow), ("application/json", follow)]
    )
    assert statuses == [200, 200, 200]


def test_raw_fragments_really_are_raw():
    """The placeholders turn into bytes json.dumps would never write."""
    data = raw_bytes(json.dumps({"a": "@@E400@@", "b": ["@@BADUTF8@@"]}).encode())
    assert data == b'{"a": 1e400, "b": ["\xff\xfe"]}'
    assert not re.search(rb"@@[A-Z0-9]+@@", raw_bytes(json.dumps(sorted(RAW)).encode()))
