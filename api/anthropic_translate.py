"""Anthropic Messages ↔ the shared chat pipeline (spec §1.4, §1.17, §2).

In: an Anthropic request body becomes an OpenAI-chat body for `start_chat` (which validates it:
sampling bounds, admission, tools, templating). Out: the completion's text events become an
Anthropic `message` object or its native SSE event stream. No generation happens here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from api.errors import ApiError, bad_request
from api.protocol_common import Completion, sse_event

# Tuples, not sets: a block's "type" may be any JSON value, and `[] in frozenset(...)` raises
# TypeError (unhashable) where `in` on a tuple compares with == (tests/test_fuzz.py).
AUDIO_BLOCKS = ("audio", "input_audio", "audio_url")
DROPPED_BLOCKS = ("thinking", "redacted_thinking")  # prior reasoning is not re-fed
PASSTHROUGH_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "xtc_probability",
    "xtc_threshold",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
)

# --- request ---------------------------------------------------------------------------------


def anthropic_to_chat(body: Mapping[str, Any], *, for_count: bool = False) -> dict[str, Any]:
    """The OpenAI-chat body for an Anthropic Messages request. Raises `ApiError` (400).

    `for_count`: a count_tokens body (no generation fields are read)."""
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages: at least one message is required", param="messages")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(raw_messages):
        messages.extend(_translate_message(message, index))

    chat: dict[str, Any] = {"messages": messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
    kwargs = _template_kwargs(body)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if for_count:
        return chat

    for key in PASSTHROUGH_FIELDS:
        if key in body:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("stop_sequences: must be an array of strings", param="stop_sequences")
        chat["stop"] = stops
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", param="stream")
    chat["stream"] = bool(stream)
    return chat


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for block in system:
            if (
                isinstance(block, Mapping)
                and block.get("type", "text") == "text"
                and isinstance(block.get("text"), str)
            ):
                texts.append(block["text"])
            else:
                raise bad_request("system: must be a string or an array of text blocks", param="system")
        return "\n".join(texts)
    raise bad_request("system: must be a string or an array of text blocks", param="system")


def _translate_message(message: Any, index: int) -> list[dict[str, Any]]:
    where = f"messages.{index}"
    if not isinstance(message, Mapping):
        raise bad_request(f"{where}: must be an object", param="messages")
    role = "assistant" if message.get("role") == "assistant" else "user"
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of content blocks", param="messages")

    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        block_where = f"{where}.content.{j}"
        if not isinstance(block, Mapping):
            raise bad_request(f"{block_where}: must be an object", param="messages")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{block_where}.text: must be a string", param="messages")
            parts.append({"type": "text", "text": block["text"]})
        elif kind in DROPPED_BLOCKS:
            continue
        elif kind == "image":
            parts.append(_image_part(block, block_where))
        elif kind == "tool_use":
            calls.append(_tool_call(block, block_where))
        elif kind == "tool_result":
            # Its own role:"tool" message, at the point it appears: before the turn's text.
            tool_messages.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _tool_result_text(block.get("content"), block_where),
                }
            )
        elif kind in AUDIO_BLOCKS:
            raise bad_request(f"{block_where}: audio content blocks are not supported", param="messages")
        else:
            raise bad_request(f"{block_where}: unsupported content block type {kind!r}", param="messages")

    out = list(tool_messages)
    if role == "assistant":
        if parts or calls:
            assistant: dict[str, Any] = {"role": "assistant", "content": _content(parts)}
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
    elif parts or not tool_messages:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _content(parts: list[dict[str, Any]]) -> Any:
    """Text-only blocks join with a newline (as `system` does); media keep the parts array."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, Mapping):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            media = source.get("media_type") or "image/png"
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"{where}.source: an image needs a base64 or url source", param="messages")


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name: a tool_use block needs a name", param="messages")
    arguments = block.get("input", {})
    return {
        "id": block.get("id") or "",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif isinstance(block, Mapping) and block.get("type") in AUDIO_BLOCKS:
                raise bad_request(f"{where}: audio content blocks are not supported", param="messages")
            else:
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                raise bad_request(f"{where}.content: unsupported tool_result block type {kind!r}", param="messages")
        return "\n".join(texts)
    raise bad_request(f"{where}.content: must be a string or an array of blocks", param="messages")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools: must be an array", param="tools")
    out = []
    for tool in tools:
        # Client tools only: server tools (web_search, bash, ...) carry no input_schema.
        if (
            isinstance(tool, Mapping)
            and isinstance(tool.get("name"), str)
            and isinstance(tool.get("input_schema"), Mapping)
        ):
            function: dict[str, Any] = {"name": tool["name"], "parameters": dict(tool["input_schema"])}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    """Only "none" changes behaviour (spec §1.4); the rest map to their OpenAI equivalents."""
    if not isinstance(choice, Mapping):
        return None
    kind = choice.get("type")
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return "auto"  # "auto", and "any" (a forced call is not enforced anywhere)


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, Mapping):
        kwargs.update(extra)
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and "enable_thinking" not in kwargs:
        if thinking.get("type") == "enabled":
            kwargs["enable_thinking"] = True
        elif thinking.get("type") == "disabled":
            kwargs["enable_thinking"] = False
    return kwargs


# --- response --------------------------------------------------------------------------------

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, matched_stop: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish_reason == "stop" and matched_stop is not None:
        return "stop_sequence", matched_stop
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage(openai_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic usage: `input_tokens` excludes prompt-cache reads, which are reported apart
    (so input_tokens + cache_read_input_tokens is the whole prompt, as clients sum them)."""
    prompt = int(openai_usage.get("prompt_tokens") or 0)
    cached = int((openai_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    out: dict[str, Any] = {
        "input_tokens": prompt - cached,
        "output_tokens": int(openai_usage.get("completion_tokens") or 0),
    }
    if cached > 0:
        out["cache_read_input_tokens"] = cached
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object; unparseable ones are kept as `{"_raw": ...}`."""
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def message_object(completion: Completion, *, message_id: str, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if completion.reasoning:
        content.append({"type": "thinking", "thinking": completion.reasoning, "signature": ""})
    if completion.content or not completion.calls:
        content.append({"type": "text", "text": completion.content})
    for call in completion.calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    reason, sequence = stop_reason(completion.finish_reason, completion.matched_stop)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(completion.usage),
    }


class AnthropicStream:
    """The native Messages event stream, built from the completion's text events."""

    def __init__(self, *, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self._index = -1
        self._open: str | None = None  # "thinking" | "text"

    def start(self) -> bytes:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message}) + self.ping()

    @staticmethod
    def ping() -> bytes:
        return sse_event("ping", {"type": "ping"})

    def add(self, events: list[Any]) -> bytes:
        out = b""
        for event in events:
            if hasattr(event, "calls"):
                out += self._close()
                for call in event.calls:
                    out += self._tool_use(call)
            elif event.text:
                kind = "thinking" if event.kind == "reasoning" else "text"
                if self._open != kind:
                    out += self._close() + self._open_block(kind)
                delta = (
                    {"type": "thinking_delta", "thinking": event.text}
                    if kind == "thinking"
                    else {"type": "text_delta", "text": event.text}
                )
                out += self._delta(delta)
        return out

    def finish(self, *, finish_reason: str | None, matched_stop: str | None, openai_usage: Mapping[str, Any]) -> bytes:
        out = self._close()
        if self._index < 0:  # an empty generation still has one (empty) text block
            out += self._open_block("text") + self._close()
        reason, sequence = stop_reason(finish_reason, matched_stop)
        out += sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(openai_usage),
            },
        )
        return out + sse_event("message_stop", {"type": "message_stop"})

    def error(self, message: str, *, error_type: str = "api_error") -> bytes:
        return sse_event("error", {"type": "error", "error": {"type": error_type, "message": message}})

    def _open_block(self, kind: str) -> bytes:
        self._index += 1
        self._open = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return sse_event(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # a thinking block ends with its (empty) signature
            out += self._delta({"type": "signature_delta", "signature": ""})
        self._open = None
        return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _tool_use(self, call: Any) -> bytes:
        self._index += 1
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        partial = json.dumps(tool_input(call.arguments), ensure_ascii=False)
        return (
            sse_event(
                "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
            )
            + self._delta({"type": "input_json_delta", "partial_json": partial})
            + sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        )


# --- errors ----------------------------------------------------------------------------------

_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}
