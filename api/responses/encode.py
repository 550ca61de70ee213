"""An admitted generation's text events → a Responses API `response` object or its native SSE
event stream, whose final object is what the response store keeps; one ResponsesStream builds
both from the same events, so a whole answer lists the items its stream would send.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from api.completion import Completion
from api.http.wire import new_id, sse_event
from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallDelta, ToolCallStart
from api.responses.tools import InputStream, ToolSet, ToolSpec


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
            "prompt_cache_key": body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None,
            "prompt_cache_retention": _retention(body.get("prompt_cache_retention")),
            "reasoning": {
                "effort": _get(body, "reasoning", "effort"),
                "summary": _one_of(_get(body, "reasoning", "summary"), ("auto", "concise", "detailed")),
            },
            "store": store,
            "temperature": body.get("temperature"),
            "text": {"format": _echo_format(_get(body, "text", "format"))},
            "tool_choice": _echo_tool_choice(body.get("tool_choice")),
            "tools": _echo_tools(body.get("tools")),
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


def _retention(value: Any) -> str | None:
    """prompt_cache_retention as OpenAI spells it back ("in-memory" is taken for "in_memory")."""
    return _one_of(value.replace("-", "_") if isinstance(value, str) else None, ("in_memory", "24h"))


def _echo_metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _echo_format(fmt: Any) -> dict[str, Any]:
    """`text.format` as the request translation applies it: json_schema / json_object, else text."""
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
    """tool_choice as the request translation applies it: a named function, a mode string, else "auto"."""
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "name": choice["name"]}
    return choice if isinstance(choice, str) else "auto"


def _echo_tools(tools: Any) -> list[dict[str, Any]]:
    """The function, custom and namespace tools the request declared (built-in ones are dropped)."""
    out: list[dict[str, Any]] = []
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "namespace":
            description = tool.get("description") if isinstance(tool.get("description"), str) else ""
            out.append({**tool, "description": description, "tools": _echo_tools(tool.get("tools"))})
        elif tool.get("type") in ("function", "custom"):
            out.append(_echo_tool(tool))
    return out


def _echo_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(tool)
    for key, kind in (("parameters", Mapping), ("description", str), ("strict", bool), ("format", Mapping)):
        if key in out and not isinstance(out[key], kind):
            out[key] = None
    return out


def _get(body: Mapping[str, Any], outer: str, inner: str) -> Any:
    value = body.get(outer)
    return value.get(inner) if isinstance(value, Mapping) else None


def error_code(status: int) -> str:
    """A stream failure's code: the request's own output constraint failing (a 4xx before the
    headers) is the client's `invalid_request_error`, anything else `server_error`."""
    return "invalid_request_error" if status < 500 else "server_error"


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason): length → incomplete, everything else completed. A stream the
    server's shutdown cut ("abort") is incomplete too, with max_output_tokens: of the reasons the
    protocol defines, the nearest to "generation stopped short of the end"."""
    if finish_reason in ("length", "abort"):
        return "incomplete", "max_output_tokens"
    return "completed", None


def item_status(response_status: str) -> str:
    """The status of the output item a response ended in: cut short unless it completed."""
    return "completed" if response_status == "completed" else "incomplete"


def reasoning_token_estimate(reasoning: str) -> int:
    """A whitespace word count, at least 1 when there was any reasoning."""
    return max(1, len(reasoning.split())) if reasoning else 0


def usage(openai_usage: Mapping[str, Any], reasoning: str) -> dict[str, Any]:
    prompt = int(openai_usage.get("prompt_tokens") or 0)
    completion = int(openai_usage.get("completion_tokens") or 0)
    cached = int((openai_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    counted = (openai_usage.get("completion_tokens_details") or {}).get("reasoning_tokens")  # a reasoning row's
    reasoning_tokens = counted if counted is not None else min(completion, reasoning_token_estimate(reasoning))
    out: dict[str, Any] = {
        "input_tokens": prompt,
        # cache_write_tokens: the current SDK requires the key; prompt-cache puts are not billed.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }
    if "speculation" in openai_usage:  # an extension: the server verifies drafts
        out["speculation"] = dict(openai_usage["speculation"])
    return out


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
    item_id: str, call: ToolCall, status: str = "completed", spec: ToolSpec | None = None
) -> dict[str, Any]:
    """A function_call item; a namespace's tool (`spec`) is named as OpenAI names it: its own name
    and its `namespace`."""
    named = {"name": call.name} if spec is None else {"name": spec.name, **_namespace(spec)}
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        **named,
        "arguments": call.arguments,
        "status": status,
    }


def custom_call_item(
    item_id: str, call_id: str, spec: ToolSpec, text: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "custom_tool_call",
        "call_id": call_id,
        "name": spec.name,
        **_namespace(spec),
        "input": text,
        "status": status,
    }


def _namespace(spec: ToolSpec) -> dict[str, str]:
    return {} if spec.namespace is None else {"namespace": spec.namespace}


def function_item_id(call: ToolCall, prefix: str = "fc") -> str:
    """A call item's own id, derived from its call id so stream and store agree."""
    suffix = re.sub(r"[^A-Za-z0-9]", "", call.id.removeprefix("call_"))
    return f"{prefix}_{suffix}" if suffix else new_id(prefix)


class ResponsesStream:
    """The Responses answer built from the completion's text events, in generation order: its
    native event stream (`start`, `add`, `finish`) and the final object, whose output is the items
    the stream sent (a whole answer is `response`; with `frames=False` no event is encoded)."""

    def __init__(
        self, meta: ResponseMeta, *, frames: bool = True, tools: ToolSet = ToolSet(), forced: ToolSpec | None = None
    ) -> None:
        """`tools`: the request's (a call of a custom tool is a custom_tool_call item, a namespace's
        tool carries its namespace); `forced`: a grammar-forced custom tool, whose input is the
        whole answer text (api/responses/tools.py)."""
        self.meta = meta
        self._frames = frames
        self._tools = tools
        self._forced = forced
        self.output: list[dict[str, Any]] = []  # finished items, as the final object lists them
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._parts: list[str] = []  # the open item's text (`+=` would copy it every token)

    def start(self) -> bytes:
        skeleton = self.meta.response(status="in_progress", output=[], usage=None)
        return self._event("response.created", response=skeleton) + self._event(
            "response.in_progress", response=skeleton
        )

    def add(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, ToolCallStart):  # every call streams: its item stays open for its arguments
                out += self._close() + self._open_call(event)
            elif isinstance(event, ToolCallDelta) and self._open is not None:
                self._open["arguments"].append(event.arguments)
                if self._open["type"] == "custom_tool_call":
                    out += self._input_delta(self._open["input"].feed(event.arguments))
                    continue
                ids = {"item_id": self._open["id"], "output_index": self._open["index"]}
                out += self._event("response.function_call_arguments.delta", **ids, delta=event.arguments)
            elif isinstance(event, TextDelta) and event.text and self._forced:  # (a template's open <think> too)
                if self._open is None or not self._open.get("forced"):
                    out += self._close() + self._open_call(
                        ToolCallStart(0, new_id("call"), self._forced.called), forced=True
                    )
                self._parts.append(event.text)
                out += self._input_delta(event.text)
            elif isinstance(event, TextDelta) and event.text:  # (ToolCallsEvent: calls already streamed)
                kind = "reasoning" if event.kind == "reasoning" else "message"
                item = self._open
                if item is None or item["type"] != kind:
                    out += self._close()
                    frames, item = self._open_item(kind)
                    out += frames
                self._parts.append(event.text)
                out += self._text_delta(item, event.text)
        return out

    def finish(
        self,
        *,
        finish_reason: str | None,
        openai_usage: Mapping[str, Any],
        reasoning: str,
        error: str | None = None,
        error_status: int = 500,
    ) -> tuple[bytes, dict[str, Any]]:
        """The closing frames and the final Response object (what the store keeps), announced
        by the event its status names: response.completed, .incomplete or .failed (`error`, with
        the HTTP status the failure would have had: `error_code`)."""
        if error is not None:
            status, incomplete = "failed", None
        else:
            status, incomplete = status_of(finish_reason)
        out = self._close(item_status(status))
        if not self.output and error is None and self._forced is not None:  # the forced call, empty
            out += self._open_call(ToolCallStart(0, new_id("call"), self._forced.called), forced=True) + self._close(
                item_status(status)
            )
        elif not self.output and error is None:  # an empty generation still answers one message
            out += self._open_item("message")[0] + self._close(item_status(status))
        final = self.meta.response(
            status=status,
            output=list(self.output),
            usage=usage(openai_usage, reasoning),
            incomplete=incomplete,
            error={"code": error_code(error_status), "message": error} if error is not None else None,
        )
        return out + self._event(f"response.{status}", response=final), final

    def response(self, completion: Completion) -> dict[str, Any]:
        """The final object of a completion whose every event was added: what `finish` announces."""
        _, final = self.finish(
            finish_reason=completion.finish_reason, openai_usage=completion.usage, reasoning=completion.reasoning
        )
        return final

    def error(self, message: str, *, status: int = 500) -> bytes:
        return self._event("error", code=error_code(status), message=message, param=None)

    # -- items

    def _open_item(self, kind: str) -> tuple[bytes, dict[str, Any]]:
        """The frames that open a reasoning or message item, and the item (now `_open`)."""
        index = len(self.output)
        self._parts = []
        if kind == "reasoning":
            item_id = new_id("rs")
            self._open = {"type": "reasoning", "id": item_id, "index": index}
            added = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
            frames = self._event("response.output_item.added", output_index=index, item=added) + self._event(
                "response.reasoning_summary_part.added",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
            return frames, self._open
        item_id = new_id("msg")
        self._open = {"type": "message", "id": item_id, "index": index}
        added = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        frames = self._event("response.output_item.added", output_index=index, item=added) + self._event(
            "response.content_part.added",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=output_text_part(""),
        )
        return frames, self._open

    def _text_delta(self, item: dict[str, Any], text: str) -> bytes:
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

    def _close(self, status: str = "completed") -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        ids = {"item_id": item["id"], "output_index": item["index"]}
        text = "".join(self._parts)
        if item["type"] == "custom_tool_call":  # its input: the decoded `input` argument, or the forced text
            stream: InputStream = item["input"]
            whole, rest = (text, "") if item["forced"] else stream.finish()
            done = custom_call_item(item["id"], item["call_id"], item["spec"], whole, status)
            out = self._input_delta(rest, item) + self._event(
                "response.custom_tool_call_input.done", **ids, input=whole
            )
        elif item["type"] == "function_call":  # a streamed call; cut short unless the response completed
            call = ToolCall(item["call_id"], item["name"], "".join(item["arguments"]))
            done = function_call_item(item["id"], call, status, item["spec"])
            out = self._event(
                "response.function_call_arguments.done", **ids, name=done["name"], arguments=call.arguments
            )
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            out = self._event("response.reasoning_summary_text.done", **ids, summary_index=0, text=text) + self._event(
                "response.reasoning_summary_part.done",
                **ids,
                summary_index=0,
                part={"type": "summary_text", "text": text},
            )
        else:
            done = message_item(item["id"], text, status)
            out = self._event(
                "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
            ) + self._event("response.content_part.done", **ids, content_index=0, part=output_text_part(text))
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=item["index"], item=done)

    def _open_call(self, start: ToolCallStart, *, forced: bool = False) -> bytes:
        """A function_call item whose arguments follow as function_call_arguments.delta events, or
        a custom_tool_call item whose input follows as custom_tool_call_input.delta events (the
        answer's text itself, when `forced`)."""
        index = len(self.output)
        call = ToolCall(start.id, start.name, "")
        spec = self._tools.resolve(start.name)
        custom = spec is not None and spec.kind == "custom"
        item_id = function_item_id(call, "ctc" if custom else "fc")
        self._parts = []
        self._open = {"id": item_id, "index": index, "call_id": start.id, "name": start.name, "spec": spec}
        self._open["arguments"] = []  # the pieces so far
        if custom:
            assert spec is not None
            self._open.update(type="custom_tool_call", input=InputStream(), forced=forced)
            added = custom_call_item(item_id, start.id, spec, "", status="in_progress")
        else:
            self._open["type"] = "function_call"
            added = function_call_item(item_id, call, "in_progress", spec if spec and spec.namespace else None)
        return self._event("response.output_item.added", output_index=index, item=added)

    def _input_delta(self, text: str, item: dict[str, Any] | None = None) -> bytes:
        item = item or self._open
        if not text or item is None:
            return b""
        return self._event(
            "response.custom_tool_call_input.delta", item_id=item["id"], output_index=item["index"], delta=text
        )

    def _event(self, event_type: str, **fields: Any) -> bytes:
        self._seq += 1
        if not self._frames:
            return b""
        return sse_event(event_type, {"type": event_type, "sequence_number": self._seq - 1, **fields})
