"""Input items as the Responses store keeps them and GET .../input_items lists them, and a stored
response's output as a continuation's input.

Items are kept in OpenAI's shapes (an id, `status`, content as parts): messages, `function_call`
(with its `namespace` when it named a namespace's tool), `function_call_output`,
`custom_tool_call` and `custom_tool_call_output`. Reasoning and item references are never re-fed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from api.http.wire import new_id

SYSTEM_ROLES = ("system", "developer")
CALL_KINDS = ("function_call", "custom_tool_call")
OUTPUT_KINDS = ("function_call_output", "custom_tool_call_output")
_ID_PREFIXES = {
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
}


def output_to_input(output: list[Any]) -> list[dict[str, Any]]:
    """A stored response's output as input items for a continuation, ids kept (the continuation's
    input_items lists them as they were answered); reasoning is dropped (replaying it invites
    repetition)."""
    items = []
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            content = item.get("content") or []
            items.append({"id": item.get("id"), "type": "message", "role": "assistant", "content": content})
        elif item.get("type") in CALL_KINDS:
            items.append({k: v for k, v in item.items() if k != "status"})
    return stored_input(items)


def stored_input(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Already translated input items as the store keeps them and GET .../input_items lists them:
    in OpenAI's item shapes (an id, `status`, content as parts: `input_text` for user / system /
    developer messages, `output_text` for the assistant's), meaning what they meant to the
    translation, so a continuation re-feeds them to the same prompt. Reasoning and item references
    (never re-fed) are left out; an unknown role is the user it was taken for. Idempotent."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        status = {"status": "completed"}
        if kind == "message":
            assistant = item.get("role") == "assistant"
            role = item.get("role") if item.get("role") in (*SYSTEM_ROLES, "assistant") else "user"
            content = [_stored_part(part, assistant) for part in _parts(item.get("content"))]
            out.append({"id": _item_id(item, "msg"), "type": "message", "role": role, **status, "content": content})
        elif kind in CALL_KINDS:
            call: dict[str, Any] = {"call_id": item.get("call_id") or item.get("id") or "", "name": item.get("name")}
            if kind == "function_call":
                arguments = item.get("arguments", "")
                call["arguments"] = arguments if isinstance(arguments, str) else json.dumps(arguments)
            else:
                value = item.get("input", "")
                call["input"] = value if isinstance(value, str) else json.dumps(value)
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                call["namespace"] = item["namespace"]
            out.append({"id": _item_id(item, _ID_PREFIXES[kind]), "type": kind, **call, **status})
        elif kind in OUTPUT_KINDS:
            output = item.get("output", "")
            if isinstance(output, list):
                output = [_stored_part(part, False) for part in output]
            elif not isinstance(output, str):
                output = json.dumps(output)
            call_id = item.get("call_id") or ""
            out.append(
                {"id": _item_id(item, _ID_PREFIXES[kind]), "type": kind, "call_id": call_id, "output": output, **status}
            )
    return out


def _item_id(item: Mapping[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _parts(content: Any) -> list[Any]:
    if content is None:
        return []
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else list(content)


def _stored_part(part: Mapping[str, Any], assistant: bool) -> dict[str, Any]:
    """A content part the translation took, in the role's part type (text parts as
    `output_text` / `input_text`, refusals the assistant's own); images as OpenAI lists them."""
    kind = part.get("type")
    if kind == "input_image":
        detail = part.get("detail") if part.get("detail") in ("low", "high", "auto") else "auto"
        return {**part, "detail": detail}
    text = part.get("refusal") if kind == "refusal" else part.get("text")
    if assistant and kind == "refusal":
        return {"type": "refusal", "refusal": text}
    if assistant:
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}
