"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /stats.

Each completion handler parses and templates on the trio side, admits through a
`RequestActor` before answering (so 400 / 503 are real HTTP statuses), then encodes the actor's
text events as one JSON body or an SSE stream (spec §1.17). Field handling lives in
`parse_generation`, the single request → SamplingParams mapping, so the protocol-completeness
work extends one function.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
from quart import Blueprint, Response, request

from actors.messages import GenerationRequest
from actors.request import GenerationFailed, RequestActor, RequestRejected
from cache.boundary import stable_prefix_length
from api.errors import ApiError, bad_request, error_body, from_rejection
from model.params import SamplingParams

log = logging.getLogger(__name__)

HEALTH_BODY = b'{"status": "ok"}'  # byte parity with mlx_lm.server, space included
DONE_FRAME = b"data: [DONE]\n\n"
CHAT_DEFAULT_MAX_TOKENS = 65_536
TEXT_DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's: an untemplated prompt may never reach EOS

# --- request fields → generation parameters (the one place) ----------------------------------


@attrs.frozen
class Generation:
    sampling: SamplingParams
    max_tokens: int
    explicit_seed: bool
    seed: int | None
    stop: tuple[str, ...]
    stream: bool


def parse_generation(
    body: Mapping[str, Any], *, defaults: SamplingParams, default_max_tokens: int, chat: bool
) -> Generation:
    temperature = _number(body, "temperature", minimum=0.0)
    top_p = _number(body, "top_p", minimum=0.0, maximum=1.0)
    sampling = attrs.evolve(
        defaults,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
    )
    max_tokens = _positive_int(body, "max_tokens")
    if chat:
        max_tokens = _positive_int(body, "max_completion_tokens") or max_tokens
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", param="seed")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    return Generation(
        sampling=sampling,
        max_tokens=max_tokens or default_max_tokens,
        # A `seed` key, even null, asks for reproducibility: the request runs serial (§1.15).
        explicit_seed="seed" in body,
        seed=None if seed is None else seed & 0xFFFFFFFF,
        stop=_stop_strings(body.get("stop")),
        stream=bool(stream),
    )


def _number(body: Mapping[str, Any], key: str, *, minimum: float, maximum: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise bad_request(f"{key} must be a number", param=key)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise bad_request(f"{key} must be {bounds}", param=key)
    return float(value)


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{key} must be a positive integer", param=key)
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    return tuple(s for s in value if isinstance(s, str) and s)  # empty / non-string dropped


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages required", param="messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a string role", param="messages")
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):  # text-only part arrays flatten to one string
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request("only text content parts are supported", param="messages")
            message["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request("message content must be a string or an array of parts", param="messages")
        out.append(message)
    return out


# --- routes ----------------------------------------------------------------------------------


def blueprint(handles: Any) -> Blueprint:
    bp = Blueprint("openai", __name__)

    @bp.get("/health")
    async def health() -> Response:
        return Response(HEALTH_BODY, content_type="application/json")

    @bp.get("/stats")
    async def stats() -> Response:
        return _json(handles.stats())

    @bp.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(handles)]})

    @bp.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        card = _model_card(handles)
        return _json({"object": "list", "data": [card] if card["id"] == model_id else []})

    @bp.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        started = await start_chat(handles, await _json_body())
        meta = _Meta("chatcmpl", "chat.completion", handles.info.name)
        if started.gen.stream:
            return _sse(_chat_stream(started.actor, meta))
        return _json(await _chat_whole(started.actor, meta))

    @bp.post("/v1/completions")
    async def completions() -> Response:
        body = await _json_body()
        prompt_text = body.get("prompt")
        if not isinstance(prompt_text, str) or not prompt_text:
            raise bad_request(
                "prompt (a non-empty string) is required (token-array prompts are not accepted, "
                "matching mlx_lm.server)",
                param="prompt",
            )
        default = handles.config.max_tokens or TEXT_DEFAULT_MAX_TOKENS
        gen = parse_generation(body, defaults=handles.sampling_defaults, default_max_tokens=default, chat=False)
        prompt = handles.tokenizer.encode(prompt_text)
        actor = await _admitted(handles, prompt, gen, think=False)
        meta = _Meta("cmpl", "text_completion", handles.info.name)
        if gen.stream:
            return _sse(_text_stream(actor, meta))
        return _json(await _text_whole(actor, meta))

    return bp


@attrs.frozen(eq=False)
class StartedChat:
    """An admitted chat completion: the actor yields text events; the caller must close it."""

    actor: RequestActor
    gen: Generation
    prompt: tuple[int, ...]


async def start_chat(handles: Any, body: Mapping[str, Any]) -> StartedChat:
    """The one chat pipeline: validate an OpenAI-chat-shaped body, template it, admit it.

    The Anthropic and Responses surfaces translate their requests into this body shape and call
    here, so validation, templating, tools, reasoning, stop handling, admission and the prompt
    cache are shared; only their encoders differ. Raises `ApiError` (400 / 503).
    """
    messages = _chat_messages(body)
    default = handles.config.max_tokens or CHAT_DEFAULT_MAX_TOKENS
    gen = parse_generation(body, defaults=handles.sampling_defaults, default_max_tokens=default, chat=True)
    try:
        prompt = handles.tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception as exc:  # template errors are the client's messages, not a crash
        raise bad_request(f"prompt build failed: {exc}") from exc
    think = bool(getattr(handles.tokenizer, "has_thinking", False))
    snapshot_at = _snapshot_position(handles, messages, prompt)
    actor = await _admitted(handles, prompt, gen, think=think, snapshot_at=snapshot_at)
    return StartedChat(actor=actor, gen=gen, prompt=tuple(prompt))


def _model_card(handles: Any) -> dict[str, Any]:
    return {
        "id": handles.info.name,
        "object": "model",
        "created": int(handles.started_at),
        "owned_by": "mlx-trio",
        "context_window": handles.info.context_length,
        "max_safe_context": handles.ceiling.max_safe_context,
        "batch_mode": handles.mode,
    }


async def _json_body() -> dict[str, Any]:
    # force=True: a missing or wrong Content-Type must not turn a valid body into None.
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise bad_request("invalid JSON body")
    return body


def _snapshot_position(handles: Any, messages: list[dict[str, Any]], prompt: Any, **template: Any) -> int | None:
    """Where the next turn's prompt stops agreeing with this one: the boundary snapshot."""
    if handles.prompt_cache is None:
        return None
    try:
        return stable_prefix_length(handles.tokenizer, messages, prompt_tokens=prompt, **template) or None
    except Exception:  # a probe failure costs a cache miss, never the request
        log.debug("stable prefix probe failed", exc_info=True)
        return None


async def _admitted(
    handles: Any, prompt: Any, gen: Generation, *, think: bool, snapshot_at: int | None = None
) -> RequestActor:
    sink = handles.make_sink(handles.tokenizer.detokenizer(), stop=gen.stop, think=think)
    generation = GenerationRequest(
        prompt=tuple(prompt),
        sampling=gen.sampling,
        max_tokens=gen.max_tokens,
        explicit_seed=gen.explicit_seed,
        seed=gen.seed,
        snapshot_at=snapshot_at,
    )
    actor = RequestActor(handles.ports, generation, sink)
    try:
        await actor.admit()
    except RequestRejected as rejected:
        raise from_rejection(rejected.rejection) from None
    except BaseException:
        actor.close()
        raise
    return actor


def _json(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload), status=status, content_type="application/json")


def _sse(body: AsyncIterator[bytes]) -> Response:
    response = Response(body, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None  # a long generation is not a stuck response
    return response


def _frame(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _failure_frame(exc: BaseException) -> bytes:
    return _frame(error_body(str(exc), type="server_error"))


class _Meta:
    """One response's id / created / model, shared by all its chunks."""

    def __init__(self, prefix: str, object_name: str, model: str) -> None:
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.object = object_name
        self.created = int(time.time())
        self.model = model

    def envelope(self, object_name: str, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        return payload


def _chat_delta(event: Any) -> dict[str, Any]:
    if hasattr(event, "calls"):
        return {"tool_calls": [_tool_call(call, index=i) for i, call in enumerate(event.calls)]}
    return {event.kind: event.text}  # "content" | "reasoning"


def _tool_call(call: Any, *, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


async def _chat_stream(actor: RequestActor, meta: _Meta) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _frame(meta.envelope("chat.completion.chunk", choice, usage))

    try:
        yield chunk({"role": "assistant", "content": ""})
        while (events := await actor.next_events()) is not None:
            for event in events:
                yield chunk(_chat_delta(event))
        yield chunk({}, actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:  # after the headers an exception would only truncate the body
        if not isinstance(exc, GenerationFailed):
            log.exception("chat stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def _chat_whole(actor: RequestActor, meta: _Meta) -> dict[str, Any]:
    content, reasoning, calls = [], [], []
    try:
        while (events := await actor.next_events()) is not None:
            for event in events:
                if hasattr(event, "calls"):
                    calls.extend(event.calls)
                elif event.kind == "reasoning":
                    reasoning.append(event.text)
                else:
                    content.append(event.text)
    except GenerationFailed as exc:
        raise ApiError(500, str(exc)) from exc
    finally:
        actor.close()
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [_tool_call(call) for call in calls]
    choice = {"index": 0, "message": message, "finish_reason": actor.finish_reason}
    return meta.envelope("chat.completion", choice, actor.usage())


async def _text_stream(actor: RequestActor, meta: _Meta) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _frame(meta.envelope("text_completion", choice, usage))

    try:
        while (events := await actor.next_events()) is not None:
            text = "".join(e.text for e in events if not hasattr(e, "calls"))
            if text:
                yield chunk(text)
        yield chunk("", actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:
        if not isinstance(exc, GenerationFailed):
            log.exception("completion stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def _text_whole(actor: RequestActor, meta: _Meta) -> dict[str, Any]:
    parts = []
    try:
        while (events := await actor.next_events()) is not None:
            parts.extend(e.text for e in events if not hasattr(e, "calls"))
    except GenerationFailed as exc:
        raise ApiError(500, str(exc)) from exc
    finally:
        actor.close()
    choice = {"index": 0, "text": "".join(parts), "logprobs": None, "finish_reason": actor.finish_reason}
    return meta.envelope("text_completion", choice, actor.usage())
