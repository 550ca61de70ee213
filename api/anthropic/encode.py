"""An admitted generation's text events → an Anthropic `message` object or its native SSE event
stream (message_start, content blocks, message_delta, message_stop), both built by one
AnthropicStream from the same events, so a whole answer holds what its stream accumulates to.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from typing import Any

from api.completion import Completion
from api.http.wire import sse_event
from api.partial_json import json_object
from api.pipeline.events import Event, TextDelta, ToolCallDelta, ToolCallStart

# "abort": a stream the server's shutdown cut; pause_turn tells the client the turn is unfinished
# and may be sent back to continue, where max_tokens would blame the request's own limit.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "pause_turn"}


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
    """A call's arguments as the `input` object: what the anthropic SDK rebuilds from them sent as
    input_json_delta pieces (the object so far of arguments a cut left unfinished; {} if none),
    always one `json.dumps` can encode (api/partial_json.py `json_object`)."""
    return json_object(arguments)


_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_use_id() -> str:
    """An id in Anthropic's shape (`toolu_01` and 22 letters or digits), not the pipeline's `call_…`."""
    return "toolu_01" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(22))


class AnthropicStream:
    """The Messages answer built from the completion's text events, in generation order: its
    native event stream (`start`, `add`, `finish`) and, from the same blocks, the whole message
    (`message`; with `frames=False` no frame is encoded). Both hold the same content: blocks open
    and close as the events come (text, calls, more text: as generated), and a tool_use `input` is
    what the anthropic SDK rebuilds from its input_json_delta pieces (`tool_input`, computed only
    by `message`: a stream sends the pieces, never the object).

    `input_tokens` is the whole prompt, `cached_tokens` its part restored from the prompt cache and
    `cache_created_tokens` the part stored at its breakpoints (both known once the row opened):
    message_start reports the same split as message_delta."""

    def __init__(
        self,
        *,
        message_id: str,
        model: str,
        input_tokens: int,
        cached_tokens: int = 0,
        cache_created_tokens: int = 0,
        frames: bool = True,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.cache_created_tokens = cache_created_tokens
        self._closed: list[tuple[dict[str, Any], str]] = []  # the closed blocks, with their text
        self._frames = frames
        self._index = -1
        self._open: dict[str, Any] | None = None  # the open block (its text or arguments still to come)
        self._pieces: list[str] = []  # the open block's text, thinking or arguments so far

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
        return self._frame("message_start", {"type": "message_start", "message": message}) + self.ping()

    @staticmethod
    def ping() -> bytes:
        return sse_event("ping", {"type": "ping"})

    def add(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, ToolCallStart):  # every call streams: its block stays open for its input
                out += self._close() + self._open_block(self._tool_use_block(event.name))
            elif isinstance(event, ToolCallDelta):
                if self._open is not None and self._open["type"] == "tool_use":
                    self._pieces.append(event.arguments)
                    out += self._delta({"type": "input_json_delta", "partial_json": event.arguments})
            elif isinstance(event, TextDelta) and event.text:  # (ToolCallsEvent: calls already streamed)
                kind = "thinking" if event.kind == "reasoning" else "text"
                if self._open is None or self._open["type"] != kind:
                    thinking = {"type": "thinking", "thinking": "", "signature": ""}
                    out += self._close() + self._open_block(
                        thinking if kind == "thinking" else {"type": "text", "text": ""}
                    )
                self._pieces.append(event.text)
                delta = (
                    {"type": "thinking_delta", "thinking": event.text}
                    if kind == "thinking"
                    else {"type": "text_delta", "text": event.text}
                )
                out += self._delta(delta)
        return out

    def finish(self, *, finish_reason: str | None, matched_stop: str | None, openai_usage: Mapping[str, Any]) -> bytes:
        out = self._end_blocks()
        reason, sequence = stop_reason(finish_reason, matched_stop)
        out += self._frame(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(openai_usage),
            },
        )
        return out + self._frame("message_stop", {"type": "message_stop"})

    def message(self, completion: Completion) -> dict[str, Any]:
        """The whole message: the blocks of every event added, then how the completion ended."""
        self._end_blocks()
        reason, sequence = stop_reason(completion.finish_reason, completion.matched_stop)
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [self._content_block(block, text) for block, text in self._closed],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(completion.usage),
        }

    def error(self, message: str, *, error_type: str = "api_error") -> bytes:
        return sse_event("error", {"type": "error", "error": {"type": error_type, "message": message}})

    def _end_blocks(self) -> bytes:
        out = self._close()
        if self._index < 0:  # an empty generation still has one (empty) text block
            out += self._open_block({"type": "text", "text": ""}) + self._close()
        return out

    @staticmethod
    def _tool_use_block(name: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": new_tool_use_id(), "name": name, "input": {}}

    def _open_block(self, block: dict[str, Any]) -> bytes:
        self._index += 1
        self._open = block
        self._pieces = []
        return self._frame(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._frame("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> bytes:
        block, self._open = self._open, None
        if block is None:
            return b""
        out = b""
        if block["type"] == "thinking":  # a thinking block ends with its (empty) signature
            out += self._delta({"type": "signature_delta", "signature": ""})
        self._closed.append((block, "".join(self._pieces)))
        return out + self._frame("content_block_stop", {"type": "content_block_stop", "index": self._index})

    @staticmethod
    def _content_block(block: dict[str, Any], text: str) -> dict[str, Any]:
        """A closed block as the whole message holds it (as a client accumulates it)."""
        if block["type"] == "thinking":
            return {**block, "thinking": text}
        if block["type"] == "text":
            return {**block, "text": text}
        return {**block, "input": tool_input(text)}

    def _frame(self, name: str, data: dict[str, Any]) -> bytes:
        return sse_event(name, data) if self._frames else b""
