"""Hypothesis strategies for request bodies and the checks on their answers (the fuzz tests)."""

from __future__ import annotations

import json
import os
from typing import Any

import pydantic
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("MLX_TRIO_FUZZ_EXAMPLES", "4"))


BODIES_PER_EXAMPLE = 20


CHAT, TEXT, MESSAGES, COUNT, RESPONSES, FLUSH = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/admin/cache/flush",
)


RAW = {
    "@@NAN@@": b"NaN",
    "@@INF@@": b"-Infinity",
    "@@E400@@": b"1e400",
    "@@NEGE400@@": b"-1e400",
    "@@BIGINT@@": b"1" + b"0" * 5000,  # past Python's 4300-digit int limit
    "@@SURROGATE@@": b'"\\ud800x"',
    "@@LOWSURROGATE@@": b'"\\udfff"',
    "@@PAIR@@": b'"\\ud83d\\ude00"',
    "@@BADUTF8@@": b'"\xff\xfe"',
    "@@OVERLONG@@": b'"\xc0\xaf"',
    "@@TRUNCUTF8@@": b'"\xe2\x82"',
    "@@DEEP@@": b"[" * 3000 + b"]" * 3000,
    "@@TINY@@": b"5e-324",
    "@@NEGZERO@@": b"-0.0",
    "@@HUGEFLOAT@@": b"1.7976931348623157e308",
}


PREV = "@@PREV@@"  # previous_response_id: swapped for the newest response id the server gave


def raw_bytes(data: bytes) -> bytes:
    for key, raw in RAW.items():
        data = data.replace(json.dumps(key).encode(), raw)
    return data


leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(sorted(RAW))
)


json_value = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


small_number = st.integers(min_value=-3, max_value=300) | st.floats(min_value=-5, max_value=5, allow_nan=False)


unit = st.floats(min_value=0, max_value=1)


count = st.integers(min_value=0, max_value=300)


text = st.text(max_size=24) | st.sampled_from(
    [
        "",
        "RAISE",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "\u0000",
        "\U0001f600",
        "\u2028",
        "a" * 300,
        "{{ raise_exception('x') }}",
        "{% for %}",
    ]
)


schema = st.sampled_from(
    [
        {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        {"type": "object"},
        {"type": "array", "items": {"type": "integer"}},
        {"enum": ["a", "b"]},
        {"type": "string", "pattern": "[a-z]+"},
        {"type": "bogus"},
        {"$ref": "#/nope"},
        {},
    ]
)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, sometimes any JSON at all."""
    return st.one_of(plausible, plausible, json_value)


def objects(required: dict, optional: dict) -> st.SearchStrategy:
    """Four shapes: plausible (most reach the engine), plausible with one field gone wrong,
    plausible with one field missing, and chaotic (every field may be anything)."""
    plausible = st.fixed_dictionaries(required, optional=optional)
    keys = sorted({*required, *optional})

    def spoil(pair):
        body, (key, junk) = pair
        return {**body, key: junk}

    def drop(pair):
        body, key = pair
        return {k: v for k, v in body.items() if k != key}

    one_wrong = st.tuples(plausible, st.tuples(st.sampled_from(keys), json_value)).map(spoil)
    one_missing = st.tuples(plausible, st.sampled_from(sorted(required) or keys)).map(drop)
    chaotic = st.fixed_dictionaries(
        {k: field(v) for k, v in required.items()}, optional={k: field(v) for k, v in optional.items()}
    )
    return st.one_of(plausible, plausible, one_wrong, one_missing, chaotic)


def _media_samples() -> dict[str, str]:
    """Small valid media, base64: a PNG (an image or a video frame), a WAV, an MP4 (with PyAV)."""
    import base64
    import io
    import wave

    import numpy as np
    from PIL import Image

    out: dict[str, str] = {"mp4": "AAAAGGZ0eXBtcDQy"}
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 90, dtype=np.uint8)).save(buf, format="PNG")
    out["png"] = base64.b64encode(buf.getvalue()).decode()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16_000)
        clip.writeframes((np.sin(np.arange(8000) * 0.1) * 3000).astype(np.int16).tobytes())
    out["wav"] = base64.b64encode(buf.getvalue()).decode()
    try:
        from tests.helpers.media import encode_video

        frames = [np.full((64, 64, 3), v, dtype=np.uint8) for v in (10, 120, 240)]
        out["mp4"] = base64.b64encode(encode_video(frames, fps=2)).decode()
    except ImportError:  # (no PyAV: a corrupt MP4 stands in)
        pass
    return out


MEDIA = _media_samples()
video_url = st.sampled_from(
    [
        f"data:video/mp4;base64,{MEDIA['mp4']}",
        f"data:video/webm;base64,{MEDIA['mp4']}",
        "data:video/mp4;base64,AAAA",
        f"data:video/jpeg;base64,{MEDIA['png']},{MEDIA['png']}",
        "data:video/jpeg;base64,,",
        "data:video/x-flv;base64,AAAA",
        "https://example.com/v.mp4",
        f"data:image/png;base64,{MEDIA['png']}",
    ]
)
video_frames = st.lists(
    field(st.sampled_from([f"data:image/png;base64,{MEDIA['png']}", "data:image/png;base64,@@", "x"])), max_size=3
)
audio_value = st.fixed_dictionaries(
    {
        "data": field(st.sampled_from([MEDIA["wav"], MEDIA["wav"][:64], "AAAA", "@@@", MEDIA["png"]])),
        "format": field(st.sampled_from(["wav", "mp3", "flac", "WAV"])),
    }
)
content_part = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["text", "image_url", "input_audio", "video_url", "video", "bogus"]))},
    optional={
        "text": field(text),
        "image_url": json_value,
        "video_url": field(st.one_of(video_url, st.fixed_dictionaries({"url": field(video_url)}))),
        "video": field(st.one_of(video_url, video_frames)),
        "input_audio": field(audio_value),
    },
)


message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant", "developer", "tool", "bogus"]))},
    optional={
        "content": field(text | st.lists(content_part, max_size=3)),
        "name": json_value,
        "tool_calls": field(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "id": field(text),
                        "type": field(st.just("function")),
                        "function": field(st.fixed_dictionaries({"name": field(text), "arguments": field(text)})),
                    }
                ),
                max_size=2,
            )
        ),
        "tool_call_id": json_value,
        "reasoning_content": json_value,
    },
)


tool = st.fixed_dictionaries(
    {
        "type": field(st.just("function")),
        "function": field(
            st.fixed_dictionaries(
                {"name": field(text)}, optional={"description": json_value, "parameters": field(schema)}
            )
        ),
    }
)


# Plausible values per field: each is sometimes replaced by any JSON at all (`field`).
SAMPLING = {
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": unit,
    "top_k": count | st.just(-1),
    "min_p": unit,
    "repetition_penalty": st.floats(min_value=0, max_value=3),
    "presence_penalty": small_number,
    "frequency_penalty": small_number,
    "repetition_context_size": count,
    "presence_context_size": count,
    "xtc_probability": unit,
    "xtc_threshold": unit,
    "seed": st.integers(min_value=-(2**70), max_value=2**70),
}


# Mostly the served name (or none), so most bodies get past the model check; any other text is a 404.
model = st.sampled_from(["fake-model", "default_model", ""]) | text


COMMON = {
    **SAMPLING,
    "model": model,
    "max_tokens": st.integers(min_value=1, max_value=300),
    "stop": text | st.lists(text, max_size=5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=11),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
    "n": st.integers(min_value=0, max_value=3),
    "user": text,
}


CHAT_ONLY = {
    "max_completion_tokens": st.integers(min_value=1, max_value=300),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])
    | st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": text, "schema": schema}) | json_value,
        }
    ),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), leaf, max_size=2),
}


TEXT_ONLY = {
    "echo": st.booleans() | json_value,
    "suffix": json_value,
    "best_of": json_value,
    "logprobs": st.integers(min_value=0, max_value=11) | json_value,  # the legacy API's count
    "return_tokens_as_token_ids": st.booleans(),
}


plain_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text})


chat_object = objects(
    {"messages": st.lists(plain_message, min_size=1, max_size=3) | st.lists(message, max_size=3)},
    {**COMMON, **CHAT_ONLY},
)


text_object = objects(
    {"prompt": st.text(min_size=1, max_size=24) | st.lists(st.integers(-5, 300), max_size=6)}, {**COMMON, **TEXT_ONLY}
)


a_text = st.fixed_dictionaries({"type": st.just("text"), "text": field(text)}, optional={"cache_control": json_value})


a_image = st.fixed_dictionaries(
    {
        "type": st.just("image"),
        "source": field(
            st.one_of(
                st.fixed_dictionaries(
                    {
                        "type": st.just("base64"),
                        "media_type": field(st.sampled_from(["image/png", "x"])),
                        "data": field(text),
                    }
                ),
                st.fixed_dictionaries({"type": st.just("url"), "url": field(text)}),
            )
        ),
    }
)


a_tool_use = st.fixed_dictionaries(
    {"type": st.just("tool_use"), "id": field(text), "name": field(text), "input": field(st.just({"x": "y"}))}
)


a_tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": field(text)},
    optional={"content": field(text | st.lists(a_text, max_size=2)), "is_error": json_value},
)


a_thinking = st.fixed_dictionaries(
    {"type": st.sampled_from(["thinking", "redacted_thinking"])},
    optional={"thinking": field(text), "signature": field(text), "data": json_value},
)


a_odd = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["audio", "input_audio", "document", "bogus", ""]))},
    optional={"text": json_value, "source": json_value},
)


a_block = st.one_of(a_text, a_text, a_image, a_tool_use, a_tool_result, a_thinking, a_odd)


a_message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["user", "assistant", "user", "system", "bogus"])),
        "content": field(text | st.lists(a_block, max_size=3)),
    }
)


a_plain = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": text})


a_tool = st.fixed_dictionaries(
    {"name": field(text), "input_schema": field(schema)},
    optional={"description": field(text), "type": field(st.sampled_from(["custom", "web_search_20250305"]))},
)


A_PROMPT = {
    "model": model,
    "system": text | st.lists(a_text, max_size=2),
    "tools": st.lists(a_tool, max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "bogus"])},
        optional={"name": text, "disable_parallel_tool_use": st.booleans()},
    ),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "bogus"])}, optional={"budget_tokens": count}
    ),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), leaf, max_size=2),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": text}),
}


A_GENERATION = {
    **SAMPLING,
    "temperature": unit,
    "stop_sequences": st.lists(text, max_size=3),
    "stream": st.booleans(),
    "service_tier": st.sampled_from(["auto", "standard_only"]),
}


a_messages = st.lists(a_plain, min_size=1, max_size=3) | st.lists(a_message, max_size=3)


messages_object = objects({"messages": a_messages, "max_tokens": st.integers(1, 300)}, {**A_PROMPT, **A_GENERATION})


count_object = objects({"messages": a_messages, "model": model}, {k: v for k, v in A_PROMPT.items() if k != "model"})


r_part = st.fixed_dictionaries(
    {
        "type": field(
            st.sampled_from(
                ["input_text", "output_text", "text", "refusal", "input_image", "input_audio", "summary_text", "bogus"]
            )
        )
    },
    optional={
        "text": field(text),
        "refusal": field(text),
        "image_url": field(text),
        "file_id": json_value,
        "input_audio": field(audio_value),
        "annotations": json_value,
    },
)


r_message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system", "developer", "bogus"]))},
    optional={
        "type": field(st.just("message")),
        "content": field(text | st.lists(r_part, max_size=3)),
        "id": json_value,
        "status": json_value,
    },
)


r_call = st.fixed_dictionaries(
    {"type": st.just("function_call"), "name": field(text), "arguments": field(text)},
    optional={"call_id": field(text), "id": json_value},
)


r_output = st.fixed_dictionaries(
    {
        "type": st.just("function_call_output"),
        "call_id": field(text),
        "output": field(text | st.lists(r_part, max_size=2)),
    }
)


r_other = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["reasoning", "item_reference", "web_search_call", "bogus"]))},
    optional={"id": json_value, "summary": json_value},
)


r_item = st.one_of(r_message, r_message, r_message, r_call, r_output, r_other)


r_tool = st.one_of(
    st.fixed_dictionaries(
        {"type": field(st.just("function")), "name": field(text)},
        optional={"description": field(text), "parameters": field(schema), "strict": json_value},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "bogus"])}),
)


R_FIELDS = {
    **SAMPLING,
    "model": model,
    "instructions": text,
    "previous_response_id": st.sampled_from([PREV, PREV, "resp_missing", ""]),
    "store": st.booleans(),
    "stream": st.booleans(),
    "max_output_tokens": st.integers(min_value=1, max_value=300),
    "tools": st.lists(r_tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries({"type": st.just("function"), "name": text}),
    "reasoning": st.fixed_dictionaries(
        {},
        optional={
            "effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"]),
            "summary": st.sampled_from(["auto", "concise", "detailed"]),
        },
    ),
    "text": st.fixed_dictionaries(
        {
            "format": st.one_of(
                st.just({"type": "text"}),
                st.just({"type": "json_object"}),
                st.fixed_dictionaries(
                    {"type": st.just("json_schema"), "name": text, "schema": schema}, optional={"strict": st.booleans()}
                ),
            )
        }
    ),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "parallel_tool_calls": st.booleans(),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "user": text,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=11),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), leaf, max_size=2),
}


responses_object = objects({"input": text | st.lists(r_item, max_size=3)}, R_FIELDS)


CONTENT_TYPES = ["application/json"] * 8 + [
    "text/plain",
    "application/x-www-form-urlencoded",
    "application/json; charset=latin-1",
    "",
]


def encoded(objects: st.SearchStrategy) -> st.SearchStrategy[tuple[str, bytes]]:
    """(Content-Type, body): mostly a generated object; else any JSON, raw bytes, a JSON text cut
    short, or one with junk bytes spliced in."""
    as_json = objects.map(lambda o: raw_bytes(json.dumps(o).encode()))
    truncated = st.tuples(as_json, st.floats(min_value=0, max_value=1)).map(
        lambda pair: pair[0][: int(len(pair[0]) * pair[1])]
    )
    spliced = st.tuples(as_json, st.floats(min_value=0, max_value=1), st.binary(min_size=1, max_size=4)).map(
        lambda t: t[0][: int(len(t[0]) * t[1])] + t[2] + t[0][int(len(t[0]) * t[1]) :]
    )
    body = st.one_of(
        as_json,
        as_json,
        as_json,
        as_json,
        as_json,
        as_json,
        as_json,
        as_json,
        json_value.map(lambda v: raw_bytes(json.dumps(v).encode())),
        st.binary(max_size=64),
        truncated,
        spliced,
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b"{}",
                b'{"messages": NaN}',
                b"\xef\xbb\xbf{}",
                b'{"a":1}' * 3,
                b'{"a":1,"a":2}',
                b"  {} ",
                b"\x00",
                b"true",
                b'"{}"',
                b"1e400",
            ]
        ),
    )
    return st.tuples(st.sampled_from(CONTENT_TYPES), body)


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def sdk_adapters() -> dict[str, Any]:
    """The SDKs' pydantic models for success bodies, where the SDKs are installed."""
    out: dict[str, Any] = {}
    try:
        import anthropic

        out["message"] = pydantic.TypeAdapter(anthropic.types.Message)
        out["message_event"] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    except ImportError:
        pass
    try:
        from openai.types import Completion
        from openai.types.chat import ChatCompletion, ChatCompletionChunk

        out["chat.completion"] = pydantic.TypeAdapter(ChatCompletion)
        out["chat.completion.chunk"] = pydantic.TypeAdapter(ChatCompletionChunk)
        out["text_completion"] = pydantic.TypeAdapter(Completion)
        from openai.types.responses import Response, ResponseStreamEvent

        out["response"] = pydantic.TypeAdapter(Response)
        out["response_event"] = pydantic.TypeAdapter(ResponseStreamEvent)
    except ImportError:
        pass
    return out


SDK = sdk_adapters()


def validate(kind: str, payload: Any) -> None:
    if kind in SDK:
        SDK[kind].validate_python(payload)


def named_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"], frame
        out.append((lines["event"], payload))
    return out


def check_error(path: str, status: int, body: Any) -> None:
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"} and isinstance(error["message"], str), error
        assert error["type"] == ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"), (status, error)
        return
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if path.startswith("/v1/responses"):
        assert error["type"] == "invalid_request_error", error


def check_answer(path: str, status: int, content_type: str, raw: bytes) -> str | None:
    """Raises unless the answer is well formed for `path`; returns a new response id, if any."""
    assert status < 500, (status, raw[:300])
    if status >= 400:
        assert content_type == "application/json", content_type
        check_error(path, status, json.loads(raw))
        return None
    if path == FLUSH:
        body = json.loads(raw)
        assert status == 200 and body["durable"] is True and body["entries"] == 0, body
        return None
    assert status == 200, status
    if content_type == "text/event-stream":
        return check_stream(path, raw)
    assert content_type == "application/json", content_type
    body = json.loads(raw)
    if path == CHAT or path == TEXT:
        want = "chat.completion" if path == CHAT else "text_completion"
        assert body["object"] == want and isinstance(body["choices"], list), body
        validate(want, body)
    elif path == MESSAGES:
        assert body["type"] == "message" and body["role"] == "assistant", body
        validate("message", body)
    elif path == COUNT:
        assert set(body) == {"input_tokens"} and isinstance(body["input_tokens"], int) and body["input_tokens"] > 0
    elif path == RESPONSES:
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
        validate("response", body)
        return body["id"]
    return None


def check_stream(path: str, raw: bytes) -> str | None:
    if path == CHAT or path == TEXT:
        frames = [f.removeprefix("data: ") for f in raw.decode().split("\n\n") if f and not f.startswith(":")]
        assert frames and frames[-1] == "[DONE]", frames[-3:]
        for frame in frames[:-1]:
            chunk = json.loads(frame)
            assert "error" not in chunk, chunk
            assert isinstance(chunk["choices"], list)
            assert chunk["object"] == ("chat.completion.chunk" if path == CHAT else "text_completion"), chunk
            # The SDK types legacy stream chunks as `Completion`, whose finish_reason is not
            # optional, yet OpenAI (and we) send null until the last one: check those fully.
            if path == CHAT or all(c.get("finish_reason") for c in chunk["choices"]):
                validate(chunk["object"], chunk)
        return None
    events = named_events(raw)
    names = [name for name, _ in events]
    assert "error" not in names, events
    if path == MESSAGES:
        assert names[0] == "message_start" and names[-1] == "message_stop", names
        for name, payload in events:
            if name != "ping":
                validate("message_event", payload)
        return None
    assert path == RESPONSES, path
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    for _, payload in events:
        validate("response_event", payload)
    final = events[-1][1]["response"]
    assert names[-1] == f"response.{final['status']}", final
    return final["id"]


# No shrinking: a batch of 20 bodies shrinks for many minutes, and the failure message already
# names the one body (and the answer) that broke the check.
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def batches(objects: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(encoded(objects), min_size=BODIES_PER_EXAMPLE, max_size=BODIES_PER_EXAMPLE)
