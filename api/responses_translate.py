"""OpenAI Responses ↔ the shared chat pipeline (spec §1.5, §1.17, §2).

In: a Responses request (string or item input, instructions, function_call /
function_call_output items, flat tools) becomes an OpenAI-chat body for `start_chat`. Out: the
completion's text events become a Response object or its native SSE event stream, whose final
object is what the response store keeps.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from api.errors import ApiError, bad_request
from api.protocol_common import Completion, new_id, sse_event

PASSTHROUGH_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logit_bias",
    "min_p",
    "xtc_probability",
    "xtc_threshold",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "chat_template_kwargs",
    "logprobs",
    "top_logprobs",
)
# Tuples, not sets: a part's "type" or an item's "role" may be any JSON value, and
# `[] in frozenset(...)` raises TypeError (unhashable) where a tuple compares with ==.
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
AUDIO_PART_TYPES = ("input_audio", "audio", "audio_url")
SYSTEM_ROLES = ("system", "developer")

# --- request ---------------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        if not all(isinstance(item, Mapping) for item in value):
            raise bad_request("input: every item must be an object", param="input")
        return [dict(item) for item in value]
    if value is None:
        raise bad_request("input: required (a string or an array of input items)", param="input")
    raise bad_request("input: must be a string or an array of input items", param="input")


def output_to_input(output: list[Any]) -> list[dict[str, Any]]:
    """A stored response's output as input items for a continuation; reasoning is dropped
    (replaying it invites repetition, spec §2)."""
    items = []
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            items.append({"type": "message", "role": "assistant", "content": item.get("content") or []})
        elif item.get("type") == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item.get("call_id"),
                    "name": item.get("name"),
                    "arguments": item.get("arguments", ""),
                }
            )
    return items


def responses_to_chat(body: Mapping[str, Any], items: list[dict[str, Any]], instructions: str | None) -> dict[str, Any]:
    """The OpenAI-chat body for the (already resolved, continuation-included) input."""
    system_texts = [instructions] if instructions else []
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _translate_item(item, index, messages, system_texts)
    if system_texts:  # one leading system message: strict templates reject a second one
        messages.insert(0, {"role": "system", "content": "\n\n".join(system_texts)})
    if not messages:
        raise bad_request("input: at least one input item is required", param="input")

    chat: dict[str, Any] = {"messages": messages}
    for key in PASSTHROUGH_FIELDS:
        if key in body:
            chat[key] = body[key]
    max_tokens = body.get("max_output_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    effort = body.get("reasoning", {}).get("effort") if isinstance(body.get("reasoning"), Mapping) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    chat["stream"] = bool(stream)
    return chat


def _translate_item(item: Mapping[str, Any], index: int, messages: list[dict[str, Any]], system: list[str]) -> None:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        text_or_parts = _content(item.get("content"), where)
        if role in SYSTEM_ROLES:
            system.append(text_or_parts if isinstance(text_or_parts, str) else _only_text(text_or_parts, where))
        elif role == "assistant":
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
                previous = messages[-1]
                if isinstance(previous["content"], str) and isinstance(text_or_parts, str):
                    previous["content"] += text_or_parts
                    return
            messages.append({"role": "assistant", "content": text_or_parts})
        else:  # user, and any unknown role
            messages.append({"role": "user", "content": text_or_parts})
    elif kind == "function_call":
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}: a function_call item needs a name", param="input")
        arguments = item.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = {
            "id": item.get("call_id") or item.get("id") or "",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        # Consecutive calls (and the assistant text before them) are one assistant turn.
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output", "")
        if not isinstance(output, str):
            output = _only_text(_content(output, where), where) if isinstance(output, list) else json.dumps(output)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": output})
    elif kind in ("reasoning", "item_reference"):
        return  # reasoning is never re-fed; references point at server-side items we do not keep
    else:
        raise bad_request(f"{where}: unsupported input item type {kind!r}", param="input")


def _content(content: Any, where: str) -> Any:
    """A string, or the parts list (text parts merged into one string when text-only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of content parts", param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, Mapping):
            raise bad_request(f"{where}.content: every part must be an object", param="input")
        kind = part.get("type")
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url") or part.get("file_id")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in AUDIO_PART_TYPES:
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio") or {}})
        else:
            raise bad_request(f"{where}.content: unsupported content part type {kind!r}", param="input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _only_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    raise bad_request(f"{where}: only text content is supported here", param="input")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", param="tools")
    out = []
    for tool in tools:  # function tools only; built-in tools (web_search, ...) are dropped
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request("a function tool needs a name", param="tools")
        function: dict[str, Any] = {
            "name": tool["name"],
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if "strict" in tool:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, str):
        return choice
    return "auto"  # allowed_tools, built-in tool types: not enforced


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` → chat `response_format` (structured output, where it is enforced)."""
    if not isinstance(text, Mapping) or not isinstance(text.get("format"), Mapping):
        return None
    fmt = text["format"]
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        if "strict" in fmt:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


# --- response --------------------------------------------------------------------------------


class ResponseMeta:
    """One response's id and the request fields its object echoes."""

    def __init__(
        self,
        body: Mapping[str, Any],
        *,
        model: str,
        instructions: str | None,
        previous_response_id: str | None,
        store: bool,
    ) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.echo = {
            "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens", body.get("max_tokens")),
            # Echoed fields the pipeline does not validate keep their value only when it has the
            # Responses schema's type, else the default: the SDK must be able to parse the object
            # (tests/test_fuzz.py validates every success with the openai SDK's models).
            "metadata": _echo_metadata(body.get("metadata")),
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "previous_response_id": previous_response_id,
            "reasoning": {
                "effort": _get(body, "reasoning", "effort"),
                "summary": _one_of(_get(body, "reasoning", "summary"), ("auto", "concise", "detailed")),
            },
            "store": store,
            "temperature": body.get("temperature"),
            "text": {"format": _echo_format(_get(body, "text", "format"))},
            "tool_choice": _echo_tool_choice(body.get("tool_choice")),
            "tools": [
                _echo_tool(t) for t in body.get("tools") or [] if isinstance(t, Mapping) and t.get("type") == "function"
            ],
            "top_p": body.get("top_p"),
            "truncation": _one_of(body.get("truncation"), ("auto", "disabled")) or "disabled",
            "user": body.get("user") if isinstance(body.get("user"), str) else None,
        }

    def response(
        self,
        *,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }


def _one_of(value: Any, allowed: tuple[str, ...]) -> str | None:
    return value if isinstance(value, str) and value in allowed else None


def _echo_metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _echo_format(fmt: Any) -> dict[str, Any]:
    """`text.format` as applied (`_response_format`): json_schema / json_object, else text."""
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        out: dict[str, Any] = {
            "type": "json_schema",
            "name": fmt.get("name") if isinstance(fmt.get("name"), str) else "response",
            "schema": fmt.get("schema") if isinstance(fmt.get("schema"), Mapping) else {},
        }
        if isinstance(fmt.get("strict"), bool):
            out["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            out["description"] = fmt["description"]
        return out
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return {"type": "text"}


def _echo_tool_choice(choice: Any) -> Any:
    """As `_tool_choice` applies it: a named function, a mode string, else "auto"."""
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "name": choice["name"]}
    return choice if isinstance(choice, str) else "auto"


def _echo_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(tool)
    for key, kind in (("parameters", Mapping), ("description", str), ("strict", bool)):
        if key in out and not isinstance(out[key], kind):
            out[key] = None
    return out


def _get(body: Mapping[str, Any], outer: str, inner: str) -> Any:
    value = body.get(outer)
    return value.get(inner) if isinstance(value, Mapping) else None


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason): length → incomplete, everything else completed."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def reasoning_token_estimate(reasoning: str) -> int:
    """Spec §1.5: a whitespace word count, at least 1 when there was any reasoning."""
    return max(1, len(reasoning.split())) if reasoning else 0


def usage(openai_usage: Mapping[str, Any], reasoning: str) -> dict[str, Any]:
    prompt = int(openai_usage.get("prompt_tokens") or 0)
    completion = int(openai_usage.get("completion_tokens") or 0)
    cached = int((openai_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        # cache_write_tokens: the current SDK requires the key; prompt-cache puts are not billed.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(completion, reasoning_token_estimate(reasoning))},
        "total_tokens": prompt + completion,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": text}], "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text)],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call: Any, status: str = "completed", arguments: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def function_item_id(call: Any) -> str:
    """The function_call item's own id, derived from its call id so stream and store agree."""
    suffix = re.sub(r"[^A-Za-z0-9]", "", call.id.removeprefix("call_"))
    return f"fc_{suffix}" if suffix else new_id("fc")


def response_object(completion: Completion, meta: ResponseMeta) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if completion.reasoning:
        output.append(reasoning_item(new_id("rs"), completion.reasoning))
    if completion.content or not completion.calls:
        output.append(message_item(new_id("msg"), completion.content))
    for call in completion.calls:
        output.append(function_call_item(function_item_id(call), call))
    status, incomplete = status_of(completion.finish_reason)
    return meta.response(
        status=status, output=output, usage=usage(completion.usage, completion.reasoning), incomplete=incomplete
    )


class ResponsesStream:
    """The native Responses event stream, built from the completion's text events."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.output: list[dict[str, Any]] = []  # finished items, as the final object lists them
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""

    def start(self) -> bytes:
        skeleton = self.meta.response(status="in_progress", output=[], usage=None)
        return self._event("response.created", response=skeleton) + self._event(
            "response.in_progress", response=skeleton
        )

    def add(self, events: list[Any]) -> bytes:
        out = b""
        for event in events:
            if hasattr(event, "calls"):
                out += self._close()
                for call in event.calls:
                    out += self._function_call(call)
            elif event.text:
                kind = "reasoning" if event.kind == "reasoning" else "message"
                if self._open is None or self._open["type"] != kind:
                    out += self._close() + self._open_item(kind)
                self._text += event.text
                out += self._text_delta(event.text)
        return out

    def finish(
        self, *, finish_reason: str | None, openai_usage: Mapping[str, Any], reasoning: str, error: str | None = None
    ) -> tuple[bytes, dict[str, Any]]:
        """The closing frames and the final Response object (what the store keeps)."""
        out = self._close()
        if not self.output and error is None:  # an empty generation still answers one message
            out += self._open_item("message") + self._close()
        if error is not None:
            status, incomplete = "failed", None
        else:
            status, incomplete = status_of(finish_reason)
        final = self.meta.response(
            status=status,
            output=list(self.output),
            usage=usage(openai_usage, reasoning),
            incomplete=incomplete,
            error={"code": "server_error", "message": error} if error is not None else None,
        )
        return out + self._event("response.completed", response=final), final

    def error(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=message, param=None)

    # -- items

    def _open_item(self, kind: str) -> bytes:
        index = len(self.output)
        self._text = ""
        if kind == "reasoning":
            item_id = new_id("rs")
            self._open = {"type": "reasoning", "id": item_id, "index": index}
            added = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
            return self._event("response.output_item.added", output_index=index, item=added) + self._event(
                "response.reasoning_summary_part.added",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
        item_id = new_id("msg")
        self._open = {"type": "message", "id": item_id, "index": index}
        added = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return self._event("response.output_item.added", output_index=index, item=added) + self._event(
            "response.content_part.added",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=output_text_part(""),
        )

    def _text_delta(self, text: str) -> bytes:
        item = self._open
        if item["type"] == "reasoning":
            return self._event(
                "response.reasoning_summary_text.delta",
                item_id=item["id"],
                output_index=item["index"],
                summary_index=0,
                delta=text,
            )
        return self._event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=item["index"],
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        ids = {"item_id": item["id"], "output_index": item["index"]}
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self._text)
            out = self._event(
                "response.reasoning_summary_text.done", **ids, summary_index=0, text=self._text
            ) + self._event(
                "response.reasoning_summary_part.done",
                **ids,
                summary_index=0,
                part={"type": "summary_text", "text": self._text},
            )
        else:
            done = message_item(item["id"], self._text)
            out = self._event(
                "response.output_text.done", **ids, content_index=0, text=self._text, logprobs=[]
            ) + self._event("response.content_part.done", **ids, content_index=0, part=output_text_part(self._text))
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=item["index"], item=done)

    def _function_call(self, call: Any) -> bytes:
        index = len(self.output)
        item_id = function_item_id(call)
        ids = {"item_id": item_id, "output_index": index}
        done = function_call_item(item_id, call)
        self.output.append(done)
        return (
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, status="in_progress", arguments=""),
            )
            + self._event("response.function_call_arguments.delta", **ids, delta=call.arguments)
            + self._event("response.function_call_arguments.done", **ids, name=call.name, arguments=call.arguments)
            + self._event("response.output_item.done", output_index=index, item=done)
        )

    def _event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(event_type, payload)


# --- errors ----------------------------------------------------------------------------------


def error_body(error: ApiError) -> dict[str, Any]:
    """The Responses error shape: OpenAI's envelope, type server_error / invalid_request_error."""
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}
