"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /stats.

Each completion handler parses and templates on the trio side, admits through a
`RequestActor` before answering (so 400 / 503 are real HTTP statuses), then encodes the actor's
text events as one JSON body or an SSE stream (spec §1.17). Field handling lives in three places:
`parse_generation` (the single request → SamplingParams mapping, spec §1.2/§1.3/§1.6/§1.7),
`_chat_messages` (messages, §1.2) and `parse_chat_options` (tools, thinking, §1.6/§1.8). Every
invalid field is a 400 in the OpenAI error shape, never a 500.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
from quart import Blueprint, Response, current_app

from actors.messages import GenerationRequest
from actors.request import GenerationFailed, RequestActor, RequestRejected
from api import structured
from api.errors import bad_request, error_body, from_rejection
from api.pipeline.think import prompt_ends_in_open_think
from api.pipeline.tools import detect_tool_format
from api.protocol_common import collect, json_body
from cache.boundary import stable_prefix_length
from model.params import SamplingParams

log = logging.getLogger(__name__)

HEALTH_BODY = b'{"status": "ok"}'  # byte parity with mlx_lm.server, space included
DONE_FRAME = b"data: [DONE]\n\n"
CHAT_DEFAULT_MAX_TOKENS = 65_536
TEXT_DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's: an untemplated prompt may never reach EOS
MAX_TOP_LOGPROBS = 11  # mlx_lm.server's cap (not OpenAI's 20)
MAX_CONTEXT_WINDOW = 2**31 - 1  # penalty context sizes are clamped here
NO_THINK_TEMPERATURE_CAP = 0.7  # spec §1.6: no-think turns run cooler unless the request says
# Used when tools are present but neither the template nor the family names a format: the
# `<tool_call>{json}</tool_call>` convention is what most templates teach (spec §1.8 buffered-text).
FALLBACK_TOOL_FORMAT = "hermes"

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_EFFORT_MESSAGE = "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'"
# Qwen3.8-style templates read a depth variable; "none" (thinking off) and unset pass nothing.
_TEMPLATE_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh"}

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_MEDIA_PARTS = {
    "image_url": "image",
    "image": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "video": "video",
    "file": "file",
    "input_file": "file",
}

# --- request fields → generation parameters (the one place) ----------------------------------


@attrs.frozen
class Generation:
    sampling: SamplingParams  # logprobs / top_logprobs set only when they will be captured
    max_tokens: int
    explicit_seed: bool
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    # What the request asked for (a stream asks but never captures: spec §1.7).
    logprobs: bool = False
    top_logprobs: int = 0
    # Sampling keys the request itself set (request > server flag > generation_config > fallback).
    explicit: frozenset[str] = frozenset()

    @property
    def captures_logprobs(self) -> bool:
        return bool(self.sampling.logprobs or self.sampling.top_logprobs)


def parse_generation(
    body: Mapping[str, Any],
    *,
    defaults: SamplingParams,
    default_max_tokens: int,
    chat: bool,
    vocab_size: int | None = None,
) -> Generation:
    """Validate and map every sampling / length / stop / stream / logprobs field.

    `defaults` are the server's (flags over generation_config.json over the fallback); a field
    the request sets wins. Messages follow mlx_lm.server's validation wording where it has one.
    `vocab_size`, when known, bounds `logit_bias` token ids.
    """
    values: dict[str, Any] = {}
    values["temperature"] = _number(body, "temperature", minimum=0.0, what="a non-negative float")
    values["top_p"] = _number(body, "top_p", minimum=0.0, maximum=1.0, what="a float between 0 and 1")
    values["top_k"] = _top_k(body)
    values["min_p"] = _number(body, "min_p", minimum=0.0, maximum=1.0, what="a float between 0 and 1")
    values["xtc_probability"] = _number(
        body, "xtc_probability", minimum=0.0, maximum=1.0, what="a float between 0.0 and 1.0"
    )
    values["xtc_threshold"] = _number(
        body, "xtc_threshold", minimum=0.0, maximum=1.0, what="a float between 0.0 and 1.0"
    )
    values["repetition_penalty"] = _number(body, "repetition_penalty", minimum=0.0, what="a non-negative float")
    values["presence_penalty"] = _number(body, "presence_penalty", what="a float")
    values["frequency_penalty"] = _number(body, "frequency_penalty", what="a float")
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        size = _int(body, name, minimum=0, what="a non-negative integer")
        # A window longer than any history is the whole history; MLX slices take 32-bit ints.
        values[name] = None if size is None else min(size, MAX_CONTEXT_WINDOW)
    values["logit_bias"] = _logit_bias(body.get("logit_bias"), vocab_size)
    explicit = frozenset(k for k, v in values.items() if v is not None)
    sampling = attrs.evolve(defaults, **{k: v for k, v in values.items() if v is not None})

    max_tokens = _int(body, "max_tokens", minimum=1, what="a positive integer")
    completion_max = _int(body, "max_completion_tokens", minimum=1, what="a positive integer")
    max_tokens = completion_max or max_tokens  # max_completion_tokens > max_tokens (both routes)

    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", param="seed")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    stream = bool(stream)

    logprobs, top_logprobs = _logprobs_fields(body)
    capture = not stream and (logprobs or top_logprobs > 0)  # streams never carry logprobs
    sampling = attrs.evolve(
        sampling,
        logprobs=bool(capture and logprobs),
        top_logprobs=top_logprobs if capture else 0,
        # response_format / guided_* / forced tool call → a grammar (api/structured.py; 400 if invalid)
        constraint=structured.request_constraint(body),
    )
    return Generation(
        sampling=sampling,
        max_tokens=max_tokens or default_max_tokens,
        # A `seed` key, even null, asks for reproducibility: the request runs serial (§1.15).
        explicit_seed="seed" in body,
        seed=None if seed is None else seed & 0xFFFFFFFF,
        stop=_stop_strings(body.get("stop")),
        stream=stream,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        explicit=explicit,
    )


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _number(
    body: Mapping[str, Any], key: str, *, what: str, minimum: float | None = None, maximum: float | None = None
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_number(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise bad_request(f"{key} must be {what}", param=key)
    return float(value)


def _int(body: Mapping[str, Any], key: str, *, minimum: int, what: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # JSON writers that emit 64.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_request(f"{key} must be {what}", param=key)
    return value


def _top_k(body: Mapping[str, Any]) -> int | None:
    if body.get("top_k") == -1:  # vLLM / llama.cpp clients spell "off" as -1
        return 0
    return _int(body, "top_k", minimum=0, what="a non-negative integer")


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """`{"token id": bias}`: JSON keys are strings, coerced to int as mlx_lm does."""
    if value is None:
        return None
    message = "logit_bias must be a dict of int to float"
    if not isinstance(value, dict):
        raise bad_request(message, param="logit_bias")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        try:
            token = int(key)
            amount = float(raw)
        except (TypeError, ValueError):
            raise bad_request(message, param="logit_bias") from None
        if isinstance(raw, bool) or not math.isfinite(amount):
            raise bad_request(message, param="logit_bias")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad_request(
                f"logit_bias token id {token} is out of range (vocabulary size {vocab_size})", param="logit_bias"
            )
        bias[token] = amount
    return tuple(sorted(bias.items()))


def _logprobs_fields(body: Mapping[str, Any]) -> tuple[bool, int]:
    """mlx_lm.server's checks and messages; `top_logprobs: -1` (its default) means unset."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be of type bool", param="logprobs")
    top = body.get("top_logprobs")
    if top is None or (top == -1 and not isinstance(top, bool)):
        top = 0
    elif isinstance(top, bool) or not isinstance(top, int):
        raise bad_request("top_logprobs must be of type int", param="top_logprobs")
    elif top < 0:
        raise bad_request("top_logprobs must be at least 0", param="top_logprobs")
    elif top > MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return bool(logprobs), top


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    return tuple(s for s in value if isinstance(s, str) and s)  # empty / non-string dropped


# --- messages ----------------------------------------------------------------------------------


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages → what chat templates read. The body is never mutated.

    `developer` becomes `system`; text part arrays flatten to one string; assistant
    `tool_calls[].function.arguments` JSON strings are parsed to objects (templates iterate or
    `tojson` them); media parts are a clear 400 until multimodal input exists.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages required", param="messages")
    return [_chat_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _chat_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", param="messages")
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        roles = ", ".join(f"'{r}'" for r in MESSAGE_ROLES)
        raise bad_request(f"{where}.role must be one of {roles}", param="messages")
    out = dict(message)
    if role == "developer":
        out["role"] = "system"
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", param="messages")
        out["tool_calls"] = _history_tool_calls(tool_calls, f"{where}.tool_calls")
    content = _flat_content(message.get("content"), f"{where}.content")
    # null content (an assistant turn that only called tools) stays absent for the template;
    # anywhere else it is an empty string, as in mlx_lm.server.
    out["content"] = None if content is None and out.get("tool_calls") else (content or "")
    if role == "tool" and message.get("tool_call_id") is not None and not isinstance(message["tool_call_id"], str):
        raise bad_request(f"{where}.tool_call_id must be a string", param="messages")
    return out


def _flat_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content parts", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{where} parts must be objects", param="messages")
        kind = part.get("type")
        if not isinstance(kind, (str, type(None))):
            raise bad_request(f"{where} part type must be a string", param="messages")
        if kind in _MEDIA_PARTS:
            raise bad_request(
                f"{kind} content parts are not supported: this server has no {_MEDIA_PARTS[kind]} input "
                "(text-only model)",
                param="messages",
                code="unsupported_content_type",
            )
        if not isinstance(part.get("text"), str):  # {type:"text"}, {type:"input_text"}, any part with text
            if kind in ("text", "input_text"):
                raise bad_request(f"{where} {kind} parts need a string 'text'", param="messages")
            raise bad_request(
                f"unsupported content part type {kind!r} in {where}: only text parts are supported",
                param="messages",
            )
        texts.append(part["text"])
    return "".join(texts)


def _history_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", param="messages")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f'{where}[{i}] must be {{"function": {{"name", "arguments"}}}}', param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # not JSON: the template renders the string as it came
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


# --- tools, tool_choice, thinking --------------------------------------------------------------


@attrs.frozen
class ChatOptions:
    tools: tuple[dict[str, Any], ...] | None  # None: no tools (absent, empty, or tool_choice "none")
    enable_thinking: bool | None  # None: the template's default
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # enable_thinking, preserve_thinking, ...


def parse_chat_options(body: Mapping[str, Any]) -> ChatOptions:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array of tool definitions", param="tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise bad_request(f"tools[{i}] must be an object", param="tools")
            if tool.get("type", "function") == "function":
                function = tool.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request(
                        f'tools[{i}] must be {{"type": "function", "function": {{"name": …}}}}', param="tools"
                    )
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) or choice in ("none", "auto", "required")):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice")
    # "auto", "required" and named-function forms are accepted but not enforced (spec §1.2).
    disabled = choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")

    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    kwargs = kwargs or {}
    template_kwargs: dict[str, Any] = {}
    for name in ("enable_thinking", "preserve_thinking"):  # other keys are ignored (spec §1.2)
        value = kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{name} must be a boolean", param="chat_template_kwargs")
        template_kwargs[name] = value

    effort = body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
        raise bad_request(REASONING_EFFORT_MESSAGE, param="reasoning_effort")
    # Thinking: explicit enable_thinking > reasoning_effort ("none" = off, any level = on) >
    # the template's default (spec §1.6; there is no --thinking flag yet).
    thinking = template_kwargs.get("enable_thinking")
    if thinking is None and effort is not None:
        thinking = effort != "none"
        template_kwargs["enable_thinking"] = thinking
    if effort in _TEMPLATE_EFFORT:
        template_kwargs["reasoning_effort"] = _TEMPLATE_EFFORT[effort]  # dropped unless the template reads it
    return ChatOptions(
        tools=None if disabled or not tools else tuple(tools),
        enable_thinking=thinking,
        template_kwargs=template_kwargs,
    )


# --- routes ----------------------------------------------------------------------------------


def blueprint(handles: Any) -> Blueprint:
    bp = Blueprint("openai", __name__)

    @bp.get("/health")
    async def health() -> Response:
        return Response(HEALTH_BODY, content_type="application/json")

    @bp.get("/stats")
    async def stats() -> Response:
        return _json(_stats(handles))

    @bp.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [_model_card(handles)]})

    @bp.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        card = _model_card(handles)
        return _json({"object": "list", "data": [card] if card["id"] == model_id else []})

    @bp.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        with handles.arrivals.arriving():
            started = await start_chat(handles, await json_body())
        meta = _Meta("chatcmpl", "chat.completion", handles.info.name)
        if started.gen.stream:
            return _sse(_chat_stream(started.actor, meta))
        return _json(await _chat_whole(started, meta, handles.tokenizer))

    @bp.post("/v1/completions")
    async def completions() -> Response:
        with handles.arrivals.arriving():
            started = await start_text(handles, await json_body())
        meta = _Meta("cmpl", "text_completion", handles.info.name)
        if started.gen.stream:
            return _sse(_text_stream(started.actor, meta))
        return _json(await _text_whole(started, meta, handles.tokenizer))

    return bp


@attrs.frozen(eq=False)
class StartedChat:
    """An admitted completion: the actor yields text events; the caller must close it."""

    actor: RequestActor
    gen: Generation
    prompt: tuple[int, ...]
    tool_format: str | None = None  # the parser in use; None = tool markup is plain content
    starts_in_reasoning: bool = False
    think: bool = False


async def start_chat(handles: Any, body: Mapping[str, Any]) -> StartedChat:
    """The one chat pipeline: validate an OpenAI-chat-shaped body, template it, admit it.

    The Anthropic and Responses surfaces translate their requests into this body shape and call
    here, so validation, templating, tools, reasoning, stop handling, admission and the prompt
    cache are shared; only their encoders differ. Raises `ApiError` (400 / 503).
    """
    messages = _chat_messages(body)
    default = handles.config.max_tokens or CHAT_DEFAULT_MAX_TOKENS
    gen = parse_generation(
        body,
        defaults=handles.sampling_defaults,
        default_max_tokens=default,
        chat=True,
        vocab_size=_vocab_size(handles.tokenizer),
    )
    options = parse_chat_options(body)
    if (
        options.enable_thinking is False
        and "temperature" not in gen.explicit
        and gen.sampling.temperature > NO_THINK_TEMPERATURE_CAP
    ):
        gen = attrs.evolve(gen, sampling=attrs.evolve(gen.sampling, temperature=NO_THINK_TEMPERATURE_CAP))
    tools = list(options.tools) if options.tools else None
    template_kwargs = _template_kwargs(handles.tokenizer, tools, options.template_kwargs)
    prompt, prompt_text = _render_prompt(handles.tokenizer, messages, tools, template_kwargs)
    think = bool(getattr(handles.tokenizer, "has_thinking", False))
    # A template that pre-fills `<think>` (Qwen3 thinking, DeepSeek-R1) starts generation inside
    # reasoning (spec §1.8).
    starts_in_reasoning = prompt_text is not None and prompt_ends_in_open_think(prompt_text)
    tool_format = _tool_format(handles, tools) if tools else None
    if tool_format is not None and gen.sampling.constraint is not None:
        # A forced tool call's grammar wraps the call in the model's own markup, known only now.
        constraint = structured.request_constraint(body, tool_format=tool_format)
        gen = attrs.evolve(gen, sampling=attrs.evolve(gen.sampling, constraint=constraint))
    snapshot_at = _snapshot_position(handles, messages, prompt, tools=tools, **template_kwargs)
    actor = await _admitted(
        handles,
        prompt,
        gen,
        snapshot_at=snapshot_at,
        sink_options={
            "think": think or starts_in_reasoning,
            "starts_in_reasoning": starts_in_reasoning,
            "tool_format": tool_format,
            "tools_present": tool_format is not None,
        },
    )
    return StartedChat(
        actor=actor,
        gen=gen,
        prompt=tuple(prompt),
        tool_format=tool_format,
        starts_in_reasoning=starts_in_reasoning,
        think=think or starts_in_reasoning,
    )


async def start_text(handles: Any, body: Mapping[str, Any]) -> StartedChat:
    """/v1/completions: a raw prompt (string, or token ids), no template, tools or think split."""
    prompt = _text_prompt(handles.tokenizer, body.get("prompt"))
    default = handles.config.max_tokens or TEXT_DEFAULT_MAX_TOKENS
    gen = parse_generation(
        body,
        defaults=handles.sampling_defaults,
        default_max_tokens=default,
        chat=False,
        vocab_size=_vocab_size(handles.tokenizer),
    )
    actor = await _admitted(handles, prompt, gen, sink_options={"think": False})
    return StartedChat(actor=actor, gen=gen, prompt=tuple(prompt))


_PROMPT_REQUIRED = "prompt (a non-empty string) or a non-empty array of token ids is required (one prompt per request)"


def _text_prompt(tokenizer: Any, value: Any) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a one-element batch is that prompt
    if isinstance(value, str) and value:
        return tokenizer.encode(value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        vocab = _vocab_size(tokenizer)
        bad = next((t for t in value if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is out of range (vocabulary size {vocab})", param="prompt")
        return list(value)
    raise bad_request(_PROMPT_REQUIRED, param="prompt")


def _vocab_size(tokenizer: Any) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _template_source(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str | None:
    try:
        return tokenizer.chat_template(tools=tools).source
    except Exception:  # no template, or a tokenizer double without one
        return None


def _template_kwargs(tokenizer: Any, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if "reasoning_effort" in kwargs and "reasoning_effort" not in (_template_source(tokenizer, tools) or ""):
        del kwargs["reasoning_effort"]  # only depth-reading templates get it (spec §1.6)
    return kwargs


def _render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> tuple[list[int], str | None]:
    """Prompt ids and, when the tokenizer can show it, the rendered text."""
    try:
        render = getattr(tokenizer, "render_chat", None)
        if render is None:
            return tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True, **kwargs), None
        text = render(messages, tools=tools, add_generation_prompt=True, **kwargs)
        return tokenizer.encode(text, add_special_tokens=True), text
    except Exception as exc:  # template errors are the client's messages, not a crash
        log.debug("prompt build failed", exc_info=True)
        raise bad_request(f"prompt build failed: {exc}") from exc


def _tool_format(handles: Any, tools: list[dict[str, Any]]) -> str:
    source = _template_source(handles.tokenizer, tools)
    model_type = getattr(handles.info, "model_type", None)
    return detect_tool_format(source, model_type) or FALLBACK_TOOL_FORMAT


def _stats(handles: Any) -> dict[str, Any]:
    stats = handles.stats()
    stats.setdefault("server", {}).setdefault("owner", "mlx-trio")
    batch = stats.setdefault("batch", {})
    batch.setdefault("kv_budget_bytes", max(0, handles.ceiling.usable_bytes))
    return stats


def _model_card(handles: Any) -> dict[str, Any]:
    routes = {rule.rule for rule in current_app.url_map.iter_rules()}
    reasoning = bool(getattr(handles.tokenizer, "has_thinking", False))
    structured_output = _grammar_available()
    defaults = handles.sampling_defaults
    capabilities = {
        "chat_completions": True,
        "text_completions": True,
        "anthropic_messages": "/v1/messages" in routes,
        "responses": "/v1/responses" in routes,
        "streaming": True,
        "tools": True,
        "structured_output": structured_output,
        "logprobs": True,
        "embeddings": False,
        "vision": False,
        "audio": False,
        "adapters": False,
        "training": False,
    }
    return {
        "id": handles.info.name,
        "object": "model",
        "created": int(handles.started_at),
        "owned_by": "mlx-trio",
        "context_window": handles.info.context_length,
        "max_safe_context": handles.ceiling.max_safe_context,
        "reasoning": reasoning,
        "vision": False,
        "audio": False,
        "batch_mode": handles.mode,
        "tools": True,
        "structured_output": structured_output,
        "embeddings": False,
        "adapters": False,
        "training": False,
        "capabilities": capabilities,
        "gen_defaults": {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k},
    }


def _grammar_available() -> bool:
    try:
        return bool(structured.grammar.available())
    except Exception:  # no grammar engine installed, or it failed to load
        return False


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
    handles: Any,
    prompt: Any,
    gen: Generation,
    *,
    sink_options: Mapping[str, Any],
    snapshot_at: int | None = None,
) -> RequestActor:
    sink = handles.make_sink(handles.tokenizer.detokenizer(), stop=gen.stop, **sink_options)
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


# --- encoders ----------------------------------------------------------------------------------


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
        payload = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage is not None:
            payload["usage"] = usage
        return payload


def logprobs_block(actor: RequestActor, gen: Generation, tokenizer: Any) -> dict[str, Any] | None:
    """mlx_lm.server's `choices[0].logprobs` (NOT OpenAI's shape, spec §1.7), or None.

    `top_logprobs > 0`: each entry is the top candidate merged with its top-k list (sorted
    descending, so the entry is the argmax), `token` the raw vocabulary piece; else
    `{id, logprob}` of the sampled token. One entry per generated token, EOS included.
    """
    if not gen.captures_logprobs:
        return None
    outs = getattr(actor, "token_logprobs", None) or []
    if not outs:
        return None
    if gen.sampling.top_logprobs > 0:
        content = []
        for out in outs:
            top = [
                {"id": t.token, "token": _piece(tokenizer, t.token), "logprob": _json_float(t.logprob)}
                for t in out.top_logprobs
            ]
            content.append({**top[0], "top_logprobs": top} if top else {})
        return {"content": content}
    return {"content": [{"id": out.token, "logprob": _json_float(out.logprob)} for out in outs]}


def _piece(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.id_to_token(token_id)
    except Exception:  # a padded-vocab id beyond the tokenizer, or a tokenizer double
        return ""


def _json_float(value: float | None) -> float | None:
    # JSON has no NaN / -Infinity; a masked (-inf) candidate reports OpenAI's floor instead.
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else -9999.0


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
            if events:  # one write for every token that was waiting: one chunk each
                yield b"".join([chunk(_chat_delta(event)) for event in events])
        yield chunk({}, actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:  # after the headers an exception would only truncate the body
        if not isinstance(exc, GenerationFailed):
            log.exception("chat stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def _chat_whole(started: StartedChat, meta: _Meta, tokenizer: Any) -> dict[str, Any]:
    done = await collect(started.actor)
    message: dict[str, Any] = {"role": "assistant", "content": done.content or (None if done.calls else "")}
    if done.reasoning:
        message["reasoning"] = done.reasoning
    if done.calls:
        message["tool_calls"] = [_tool_call(call) for call in done.calls]
    choice: dict[str, Any] = {"index": 0, "message": message}
    block = logprobs_block(started.actor, started.gen, tokenizer)
    if block is not None:
        choice["logprobs"] = block
    choice["finish_reason"] = done.finish_reason
    return meta.envelope("chat.completion", choice, done.usage)


async def _text_stream(actor: RequestActor, meta: _Meta) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _frame(meta.envelope("text_completion", choice, usage))

    try:
        while (events := await actor.next_events()) is not None:
            # One chunk per text event (about one per token), all waiting ones in one write.
            frames = [chunk(e.text) for e in events if not hasattr(e, "calls") and e.text]
            if frames:
                yield b"".join(frames)
        yield chunk("", actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:
        if not isinstance(exc, GenerationFailed):
            log.exception("completion stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def _text_whole(started: StartedChat, meta: _Meta, tokenizer: Any) -> dict[str, Any]:
    done = await collect(started.actor)  # no think split or tools here: all text is content
    choice = {
        "index": 0,
        "text": done.content,
        "logprobs": logprobs_block(started.actor, started.gen, tokenizer),
        "finish_reason": done.finish_reason,
    }
    return meta.envelope("text_completion", choice, done.usage)
