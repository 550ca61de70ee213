"""OpenAI Responses bodies → the typed chat requests of api/chat_request.py.

A request's input (a string or items: messages, function_call / function_call_output items;
instructions; a continuation's stored items before it) becomes template-ready messages with one
leading system message; flat function tools become the nested shape templates read. The request's
own shape is checked first, then what the server cannot take (media parts, non-string call ids),
then the generation fields (api/fields.py, named as in OpenAI), structured output, tool_choice
and reasoning. Raises `ApiError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from api import structured
from api.chat_request import ChatPrompt, ChatRequest
from api.errors import ApiError, bad_request
from api.fields import parse_generation, pick, reasoning_options, stream_flag
from api.images import PLACEHOLDER, ImagePart, from_url
from api.template_messages import media_error, template_arguments, tool_call_id_error

GENERATION_FIELDS = (
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
    "logprobs",
    "top_logprobs",
)
TOOL_CHOICES = ("none", "auto", "required")
# Tuples, not sets: a part's "type" or an item's "role" may be any JSON value, and
# `[] in frozenset(...)` raises TypeError (unhashable) where a tuple compares with ==.
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
AUDIO_PART_TYPES = ("input_audio", "audio", "audio_url")
SYSTEM_ROLES = ("system", "developer")


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
    (replaying it invites repetition)."""
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


def responses_request(
    body: Mapping[str, Any],
    items: list[dict[str, Any]],
    instructions: str | None,
    *,
    vocab_size: int | None,
    vision: bool = False,
) -> ChatRequest:
    """The chat request for the (already resolved, continuation-included) input items.
    `vocab_size`, when known, bounds `logit_bias` token ids; `vision`: the model takes images
    (else an image part is a 400)."""
    turns = _Turns([instructions] if instructions else [], vision=vision)
    for index, item in enumerate(items):
        turns.add_item(item, index)
    messages = turns.messages()
    if not messages:
        raise bad_request("input: at least one input item is required", param="input")

    fields = pick(body, GENERATION_FIELDS)
    max_tokens = body.get("max_output_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body["tool_choice"]) if "tool_choice" in body else None
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    response_format = _response_format(body.get("text"))
    stream = stream_flag(body.get("stream", False), "stream must be a boolean")
    unsupported = turns.unsupported()
    if unsupported is not None:
        raise unsupported

    generation = parse_generation(fields, vocab_size=vocab_size, stream=stream)
    constraint = structured.request_constraint(
        structured.ConstraintFields(response_format=response_format),
        structured.forced_tool_call(tools, choice),
    )
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice")
    prompt = ChatPrompt(
        messages=messages,
        tools=None if choice == "none" or not tools else tuple(tools),
        reasoning=reasoning_options(body.get("chat_template_kwargs"), effort),
        images=tuple(turns.images),
    )
    return ChatRequest(prompt=prompt, generation=generation, constraint=constraint)


@attrs.define
class _Turns:
    """The conversation being built from input items."""

    system: list[str]
    turns: list[dict[str, Any]] = attrs.Factory(list)
    # The first turn the server cannot take: (its index, its media part type, or None for a
    # call id that is not a string).
    problem: tuple[int, str | None] | None = None
    images: list[ImagePart] = attrs.Factory(list)  # in prompt order (api/images.py)
    vision: bool = False  # the model takes images (else an image part is a 400)

    def messages(self) -> tuple[dict[str, Any], ...]:
        # One leading system message: strict templates reject a second one.
        head = [{"role": "system", "content": "\n\n".join(self.system)}] if self.system else []
        return (*head, *self.turns)

    def unsupported(self) -> ApiError | None:
        if self.problem is None:
            return None
        index, media = self.problem
        if media is not None:
            return media_error(media)
        return tool_call_id_error(f"messages[{index + bool(self.system)}]")

    def _append(self, message: dict[str, Any], *, unsupported: bool = False, media: str | None = None) -> None:
        if self.problem is None and (unsupported or media is not None):
            self.problem = (len(self.turns), media)
        self.turns.append(message)

    def add_item(self, item: Mapping[str, Any], index: int) -> None:
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            self._add_message(item, where)
        elif kind == "function_call":
            self._add_call(item, where)
        elif kind == "function_call_output":
            output = item.get("output", "")
            if not isinstance(output, str):
                output = _only_text(_content(output, where), where) if isinstance(output, list) else json.dumps(output)
            call_id = item.get("call_id") or ""
            message = {"role": "tool", "tool_call_id": call_id, "content": output}
            self._append(message, unsupported=not isinstance(call_id, str))
        elif kind in ("reasoning", "item_reference"):
            return  # reasoning is never re-fed; references point at server-side items we do not keep
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r}", param="input")

    def _add_message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        images = self.images if self.vision and role not in SYSTEM_ROLES else None
        text, media = _content(item.get("content"), where, images)
        if role in SYSTEM_ROLES:
            self.system.append(_only_text((text, media), where))
            return
        if role == "assistant":
            previous = self.turns[-1] if self.turns else None
            if (
                media is None
                and previous is not None
                and previous["role"] == "assistant"
                and not previous.get("tool_calls")
            ):
                previous["content"] += text  # consecutive assistant text is one turn
                return
            self._append({"role": "assistant", "content": text}, media=media)
        else:  # user, and any unknown role
            self._append({"role": "user", "content": text}, media=media)

    def _add_call(self, item: Mapping[str, Any], where: str) -> None:
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}: a function_call item needs a name", param="input")
        call = {
            "id": item.get("call_id") or item.get("id") or "",
            "type": "function",
            "function": {"name": name, "arguments": template_arguments(item.get("arguments", ""))},
        }
        # Consecutive calls (and the assistant text before them) are one assistant turn.
        if self.turns and self.turns[-1]["role"] == "assistant":
            self.turns[-1].setdefault("tool_calls", []).append(call)
        else:
            self._append({"role": "assistant", "content": "", "tool_calls": [call]})


def _content(content: Any, where: str, images: list[ImagePart] | None = None) -> tuple[str, str | None]:
    """The content's text (parts joined) and the chat part type of its first media part, if any.
    With `images`, an `input_image` part is the image placeholder in the text and an entry there
    (api/images.py: a model without vision answers 400 there)."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of content parts", param="input")
    texts: list[str] = []
    media: str | None = None
    for part in content:
        if not isinstance(part, Mapping):
            raise bad_request(f"{where}.content: every part must be an object", param="input")
        kind = part.get("type")
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind == "input_image" and images is not None:
            images.append(from_url(part.get("image_url"), "image_url", f"{where}.content", "input"))
            texts.append(PLACEHOLDER)
        elif kind == "input_image":
            media = media or "image_url"
        elif kind in AUDIO_PART_TYPES:
            media = media or "input_audio"
        else:
            raise bad_request(f"{where}.content: unsupported content part type {kind!r}", param="input")
    return "".join(texts), media


def _only_text(content: tuple[str, str | None], where: str) -> str:
    text, media = content
    if media is not None:
        raise bad_request(f"{where}: only text content is supported here", param="input")
    return text


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
    """In OpenAI chat's terms: a named function, a mode string, else "auto"."""
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
