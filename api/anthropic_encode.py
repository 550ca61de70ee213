"""An admitted generation's text events → an Anthropic `message` object or its native SSE event
stream (message_start, content blocks, message_delta, message_stop).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from api.completion import Completion
from api.pipeline.events import Event, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart
from api.wire import sse_event

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, matched_stop: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish_reason == "stop" and matched_stop is not None:
        return "stop_sequence", matched_stop
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage(openai_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic usage: `input_tokens` excludes prompt-cache reads and the tokens stored at the
    request's cache breakpoints, which are reported apart (input_tokens + cache_read_input_tokens
    + cache_creation_input_tokens is the whole prompt, as clients sum them)."""
    prompt = int(openai_usage.get("prompt_tokens") or 0)
    details = openai_usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    created = int(details.get("cache_creation_tokens") or 0)
    out: dict[str, Any] = {
        "input_tokens": prompt - cached - created,
        "output_tokens": int(openai_usage.get("completion_tokens") or 0),
    }
    if created > 0:
        out["cache_creation_input_tokens"] = created
    if cached > 0:
        out["cache_read_input_tokens"] = cached
    if "speculation" in openai_usage:  # an extension: the server verifies drafts
        out["speculation"] = dict(openai_usage["speculation"])
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
    """The native Messages event stream, built from the completion's text events.

    `input_tokens` is the whole prompt, `cached_tokens` its part restored from the prompt cache and
    `cache_created_tokens` the part stored at its breakpoints (both known once the row opened):
    message_start reports the same split as message_delta."""

    def __init__(
        self, *, message_id: str, model: str, input_tokens: int, cached_tokens: int = 0, cache_created_tokens: int = 0
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.cache_created_tokens = cache_created_tokens
        self._index = -1
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._streamed: set[str] = set()  # the calls whose tool_use block went out piece by piece

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(
                {
                    "prompt_tokens": self.input_tokens,
                    "prompt_tokens_details": {
                        "cached_tokens": self.cached_tokens,
                        "cache_creation_tokens": self.cache_created_tokens,
                    },
                }
            ),
        }
        return sse_event("message_start", {"type": "message_start", "message": message}) + self.ping()

    @staticmethod
    def ping() -> bytes:
        return sse_event("ping", {"type": "ping"})

    def add(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, ToolCallStart):  # a streamed call: its block stays open for its input
                out += self._close() + self._open_tool_use(event)
            elif isinstance(event, ToolCallDelta):
                out += self._delta({"type": "input_json_delta", "partial_json": event.arguments})
            elif isinstance(event, ToolCallsEvent):  # every call, at the end: send those not streamed
                unsent = [call for call in event.calls if call.id not in self._streamed]
                if unsent:
                    out += self._close()
                for call in unsent:
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

    def _open_tool_use(self, start: ToolCallStart) -> bytes:
        """A tool_use block whose input follows as input_json_delta pieces of the arguments text
        (concatenated, they are the arguments the whole answer's `input` is parsed from)."""
        self._index += 1
        self._open = "tool_use"
        self._streamed.add(start.id)
        block = {"type": "tool_use", "id": start.id, "name": start.name, "input": {}}
        return sse_event(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _tool_use(self, call: ToolCall) -> bytes:
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
