"""OpenAI Responses bodies → the typed chat requests of api/chat_request.py.

A request's input (a string or items: messages, function_call / function_call_output and
custom_tool_call / custom_tool_call_output items; instructions; a continuation's stored items
before it) becomes template-ready messages with one leading system message; function, custom and
namespace tools become the nested function shape templates read (api/responses/tools.py). The request's
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
from api.cache_hints import cache_hints, retention_points
from api.chat_request import ChatPrompt, ChatRequest
from api.errors import ApiError, bad_request
from api.fields import flag, integer, parse_generation, pick, reasoning_options, stream_flag, token_count
from api.images import PLACEHOLDER, PLACEHOLDERS, ImagePart, audio_from_input, from_url
from api.responses.items import SYSTEM_ROLES, output_to_input, stored_input
from api.responses.tools import INPUT, ToolSet, tool_set
from api.template_messages import media_error, template_arguments

__all__ = ["input_items", "output_to_input", "responses_request", "stored_input"]

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
)  # not logprobs / top_logprobs: output_text parts carry no logprobs here, so none are captured
TOOL_CHOICES = ("none", "auto", "required")
# Tuples, not sets: a part's "type" or an item's "role" may be any JSON value, and
# `[] in frozenset(...)` raises TypeError (unhashable) where a tuple compares with ==.
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
AUDIO_PART_TYPES = ("input_audio", "audio", "audio_url")
TEXT_FORMATS = ("text", "json_object", "json_schema")
# OpenAI's metadata bounds: at most 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# OpenAI's documented `include` values: accepted (none adds anything here), any other is a 400.
INCLUDE_VALUES = (
    "file_search_call.results",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "message.output_text.logprobs",
    "web_search_call.action.sources",
)
# Shared code names chat's fields; a 400 from it names Responses' own.
PARAMS = {"response_format": "text.format", "guided_grammar": "tools", "guided_regex": "tools"}
METADATA_MESSAGE = (
    f"metadata must be an object of at most {METADATA_PAIRS} string keys (at most {METADATA_KEY_CHARS} characters)"
    f" with string values (at most {METADATA_VALUE_CHARS} characters)"
)


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
    toolset = tool_set(body.get("tools"))
    turns = _Turns([instructions] if instructions else [], vision=vision, toolset=toolset)
    for index, item in enumerate(items):
        turns.add_item(item, index)
    messages = turns.messages()
    if not messages and turns.reference is not None:
        raise bad_request(
            f"{turns.reference}: item_reference items are not supported: the server keeps no items to refer to "
            "(send the items themselves, or previous_response_id)",
            param="input",
        )
    if not messages:
        raise bad_request("input: at least one input item is required", param="input")

    fields = pick(body, GENERATION_FIELDS)
    # Responses names the length max_output_tokens (max_tokens is taken too), and so do its 400s.
    length_name = "max_output_tokens" if "max_output_tokens" in body else "max_tokens"
    max_tokens = token_count(body.get(length_name), length_name)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    tools = toolset.template_tools()
    forced = toolset.forced_custom(body.get("tool_choice"))
    choice = _tool_choice(body["tool_choice"], toolset) if "tool_choice" in body else None
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise bad_request("reasoning must be an object", param="reasoning")
    effort = reasoning.get("effort") if reasoning is not None else None
    # The reasoning budget (the server's thinking_token_budget), named as Responses names it.
    budget = integer(
        (reasoning or {}).get("max_tokens"), "reasoning.max_tokens", minimum=0, what="a non-negative integer"
    )
    response_format = _response_format(body.get("text"))
    stream = stream_flag(body.get("stream", False), "stream must be a boolean")
    _check_metadata(body.get("metadata"))
    flag(body.get("store"), "store")  # read by the route
    parallel = flag(body.get("parallel_tool_calls"), "parallel_tool_calls") is not False
    _check_include(body.get("include"))
    hints = cache_hints(body)
    unsupported = turns.unsupported()
    if unsupported is not None:
        raise unsupported

    generation = attrs.evolve(parse_generation(fields, vocab_size=vocab_size, stream=stream), thinking_budget=budget)
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice")
    _check_tool_choice(choice, tools)
    constraint_fields = structured.ConstraintFields(response_format=response_format)
    if forced is not None and forced.grammar is not None:  # the whole output is the call's input
        syntax, definition = forced.grammar
        regex = definition if syntax == "regex" else None
        constraint_fields = structured.ConstraintFields(
            guided_regex=regex, guided_grammar=None if regex else definition
        )
        choice = "auto"
    try:
        forced_call = structured.forced_tool_call(tools, choice, parallel=parallel)
        constraint = structured.request_constraint(constraint_fields, forced_call)
    except ApiError as error:
        error.param = PARAMS.get(error.param or "", error.param)
        raise
    if constraint is not None and constraint.param in PARAMS:  # named again if it cannot compile
        constraint = attrs.evolve(constraint, param=PARAMS[constraint.param])
    prompt = ChatPrompt(
        messages=messages,
        tools=None if choice == "none" or not tools else tuple(tools),
        reasoning=reasoning_options(body.get("chat_template_kwargs"), effort, effort_param="reasoning.effort"),
        images=tuple(turns.images),
        param="input",
    )
    return ChatRequest(
        prompt=prompt,
        generation=generation,
        constraint=constraint,
        parallel_tool_calls=parallel,
        cache_points=retention_points(messages, hints),
        cache_key=hints.key,
    )


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise bad_request("include must be an array of strings", param="include")
    unknown = [value for value in include if value not in INCLUDE_VALUES]
    if unknown:
        known = ", ".join(repr(value) for value in INCLUDE_VALUES)
        raise bad_request(f"include: unknown value {unknown[0]!r} (known: {known})", param="include")


@attrs.define
class _Turns:
    """The conversation being built from input items."""

    system: list[str]
    turns: list[dict[str, Any]] = attrs.Factory(list)
    # The first item the server cannot take: (where it is, its media part type, or None for a
    # call id that is not a string).
    problem: tuple[str, str | None] | None = None
    reference: str | None = None  # where the first item_reference is (dropped: nothing is kept to resolve it)
    images: list[ImagePart] = attrs.Factory(list)  # in prompt order (api/images.py)
    vision: bool = False  # the model takes images (else an image part is a 400)
    toolset: ToolSet = ToolSet()  # the request's tools: how an earlier call's name was shown

    def messages(self) -> tuple[dict[str, Any], ...]:
        # One leading system message: strict templates reject a second one.
        head = [{"role": "system", "content": "\n\n".join(self.system)}] if self.system else []
        return (*head, *self.turns)

    def unsupported(self) -> ApiError | None:
        if self.problem is None:
            return None
        where, media = self.problem
        if media is not None:
            error = media_error(media)
            error.param = "input"
            return error
        return bad_request(f"{where}.call_id must be a string", param="input")

    def _append(
        self, message: dict[str, Any], where: str, *, unsupported: bool = False, media: str | None = None
    ) -> None:
        if self.problem is None and (unsupported or media is not None):
            self.problem = (where, media)
        self.turns.append(message)

    def add_item(self, item: Mapping[str, Any], index: int) -> None:
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            self._add_message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._add_call(item, where, kind)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            if not isinstance(output, str):
                output = _only_text(_content(output, where), where) if isinstance(output, list) else json.dumps(output)
            call_id = item.get("call_id")
            if call_id is None or call_id == "":
                raise bad_request(f"{where}.call_id: required (the call_id of the call it answers)", param="input")
            message = {"role": "tool", "tool_call_id": call_id, "content": output}
            self._append(message, where, unsupported=not isinstance(call_id, str))
        elif kind == "reasoning":
            return  # never re-fed
        elif kind == "item_reference":
            self.reference = self.reference or where  # points at a server-side item we do not keep
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
            self._append({"role": "assistant", "content": text}, where, media=media)
        else:  # user, and any unknown role
            self._append({"role": "user", "content": text}, where, media=media)

    def _add_call(self, item: Mapping[str, Any], where: str, kind: str) -> None:
        name, namespace = item.get("name"), item.get("namespace")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}: a {kind} item needs a name", param="input")
        if kind == "custom_tool_call":  # as the model called it: its input as the one argument
            value = item.get("input", "")
            arguments = {INPUT: value if isinstance(value, str) else json.dumps(value)}
        else:
            arguments = template_arguments(item.get("arguments", ""))
        called = self.toolset.called_name(name, namespace if isinstance(namespace, str) else None)
        call = {
            "id": item.get("call_id") or item.get("id") or "",
            "type": "function",
            "function": {"name": called, "arguments": arguments},
        }
        # Consecutive calls (and the assistant text before them) are one assistant turn.
        if self.turns and self.turns[-1]["role"] == "assistant":
            self.turns[-1].setdefault("tool_calls", []).append(call)
        else:
            self._append({"role": "assistant", "content": "", "tool_calls": [call]}, where)


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
        if kind in TEXT_PART_TYPES or kind == "refusal":
            field = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(field), str):
                raise bad_request(f"{where}.content: {kind} parts need a string {field!r}", param="input")
            texts.append(part[field])
        elif kind == "input_image" and images is not None:
            images.append(from_url(part.get("image_url"), "image_url", f"{where}.content", "input"))
            texts.append(PLACEHOLDER)
        elif kind == "input_image":
            media = media or "image_url"
        elif kind == "input_audio" and images is not None:  # (api/images.py: the model must take audio)
            images.append(audio_from_input(part.get("input_audio"), kind, f"{where}.content", "input"))
            texts.append(PLACEHOLDERS["audio"])
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


def _tool_choice(choice: Any, toolset: ToolSet) -> Any:
    """In OpenAI chat's terms: a named function (a namespace's by its prompt name), a forced
    custom tool as the function call of its input (one with a grammar is constrained otherwise:
    `responses_request`), a mode string, else "auto"."""
    if isinstance(choice, Mapping) and choice.get("type") in ("function", "custom"):
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name must be a string", param="tool_choice")
        spec = toolset.resolve(choice["name"])
        return {"type": "function", "function": {"name": spec.called if spec else choice["name"]}}
    if isinstance(choice, str):
        return choice
    return "auto"  # allowed_tools, built-in tool types: not enforced


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> None:
    """A choice that can only be met by a function tool the request has."""
    names = [tool["function"]["name"] for tool in tools]
    if choice == "required" and not names:
        raise bad_request(
            "tool_choice 'required' needs at least one function tool (or custom tool) in tools", param="tool_choice"
        )
    if isinstance(choice, Mapping) and choice["function"]["name"] not in names:
        raise bad_request(
            f"tool_choice names {choice['function']['name']!r}, which is not in tools", param="tool_choice"
        )


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if (
        not isinstance(metadata, Mapping)
        or len(metadata) > METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= METADATA_KEY_CHARS for k in metadata)
        or not all(isinstance(v, str) and len(v) <= METADATA_VALUE_CHARS for v in metadata.values())
    ):
        raise bad_request(METADATA_MESSAGE, param="metadata")


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` → chat `response_format` (structured output, where it is enforced); any
    other format type is a 400, as chat's response_format is."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise bad_request("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad_request("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in TEXT_FORMATS:
        raise bad_request(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="text.format"
        )
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "text":
        return None
    if "schema" in fmt and not isinstance(fmt["schema"], Mapping):
        raise bad_request("text.format.schema must be a JSON schema object", param="text.format")
    if "strict" in fmt and fmt["strict"] is not None and not isinstance(fmt["strict"], bool):
        raise bad_request("text.format.strict must be a boolean", param="text.format")
    if "schema" not in fmt:  # both required by OpenAI's json_schema format
        raise bad_request("text.format.schema is required for type 'json_schema'", param="text.format")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise bad_request("text.format.name is required for type 'json_schema' (a string)", param="text.format")
    schema = {"name": fmt["name"], "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        schema["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": schema}
