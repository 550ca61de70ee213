"""Anthropic Messages bodies → the typed chat requests of api/chat_request.py.

The request's own shape is checked first (messages, their roles and blocks, system, tools,
tool_choice, thinking, output_config, context_management, stop_sequences, stream); then what the
server cannot take (image blocks, non-string tool ids), then the generation fields (api/fields.py,
named as in OpenAI) and a forced tool call (tool_choice "any" or "tool": a grammar,
api/structured.py). Messages are built in the shape chat templates read. A block's
`cache_control` becomes a `CachePoint`: the conversation cut after that block (a text block cuts
its message's text there; any other block keeps its whole message; a tool definition marks the
leading system messages, where templates render tools). The fields that steer generation
(thinking, output_config, context_management, metadata) are read by api/anthropic/controls.py.
Raises `ApiError`.

The API keeps growing, and clients send what it accepts today: a value of the wrong kind is a
400, but a field, block type, thinking type, effort level or context edit this server does not
know is ignored and named in `ChatRequest.ignored` (counted in /metrics), never refused.
- `system` messages inside `messages` (mid-conversation system turns) stay where they are; the
  chat core joins them to the system prompt for templates that cannot render them there.
- `thinking`: "enabled" and "adaptive" turn the template's thinking on, "disabled" off; an
  enabled one's `budget_tokens` (at least 1024, less than `max_tokens`) is the row's reasoning budget.
- `output_config.effort` (low / medium / high / max) is the template's reasoning depth where the
  template reads one; `output_config.format` (or the older `output_format`) a JSON schema.
- Earlier turns' thinking blocks reach the template as the assistant's `reasoning_content` (the
  template decides what it renders); a `clear_thinking_*` context edit drops all but the last N
  thinking turns (`keep`, default 1; "all" keeps every one).
- A leading system text block that is client billing metadata (`x-anthropic-billing-header: ...`)
  is not rendered: it changes with every conversation and would defeat the prompt cache.
- A tool with `defer_loading: true` is left out of the prompt until a `tool_reference` block
  (a tool search's result) names it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import attrs

from api import structured
from api.anthropic import controls as controls
from api.chat_request import CachePoint, ChatPrompt, ChatRequest
from api.errors import ApiError, bad_request
from api.fields import parse_generation, pick, reasoning_options, stop_strings, stream_flag
from api.images import PLACEHOLDER, ImagePart, from_base64, from_url
from api.template_messages import media_error

log = logging.getLogger(__name__)

# Tuples, not sets: a block's "type" may be any JSON value, and `[] in frozenset(...)` raises
# TypeError (unhashable) where `in` on a tuple compares with ==.
AUDIO_BLOCKS = ("audio", "input_audio", "audio_url", "video", "video_url")
# The Messages API has no audio or video blocks: a clear 400 naming where such input goes.
AUDIO_MESSAGE = (
    "audio and video content blocks are not supported: the Messages API has none; send audio as "
    "input_audio parts and video as video_url parts to /v1/chat/completions (a model that takes them)"
)
GENERATION_FIELDS = (
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
# Every top-level field this server reads; any other is ignored and reported (`ChatRequest.ignored`).
READ_FIELDS = (
    *GENERATION_FIELDS,
    "model",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "metadata",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "output_format",
    "context_management",
    "chat_template_kwargs",
    "adapter",
)
MAX_TEMPERATURE = 1.0  # Anthropic's range is 0..1
# Anthropic's rule for a client tool's name.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_NAME_MESSAGE = "must be a string of 1 to 64 letters, digits, underscores or hyphens"
ROLES = ("user", "assistant", "system")  # `system` in messages: a mid-conversation system turn
# tool_choice.type → OpenAI's tool_choice: "any" forces one call of any tool (a grammar, as
# "required"), "none" drops the tools; "tool" (a named one) is mapped on its own.
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
TOOL_CHOICE_MESSAGE = "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'"
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control.ttl → seconds ("5m" when absent)
MAX_CACHE_POINTS = 4  # Anthropic's limit on blocks with cache_control
# A system block some clients (Claude Code) send as billing metadata, not as a prompt: it carries a
# per-conversation hash, so rendering it would make every new conversation miss the prompt cache.
BILLING_HEADER = "x-anthropic-billing-header:"


def messages_request(body: Mapping[str, Any], *, vision: bool = False) -> ChatRequest:
    """POST /v1/messages (`vision`: the model takes images, else an image block is a 400)."""
    parsed = _parse(body, vision)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise bad_request("stop_sequences: must be an array of strings", param="stop_sequences")
    stream = stream_flag(body.get("stream", False), "stream: must be a boolean")
    if parsed.unsupported is not None:
        raise parsed.unsupported
    if body.get("max_tokens") is None:  # required by the Messages API (count_tokens takes none)
        raise bad_request("max_tokens: Field required", param="max_tokens")
    controls.check_metadata(body.get("metadata"))
    fields = pick(body, GENERATION_FIELDS)
    generation = parse_generation(fields, vocab_size=None, stream=stream, max_temperature=MAX_TEMPERATURE)
    budget = controls.thinking_budget(body, generation.max_tokens)
    generation = attrs.evolve(generation, thinking_budget=budget)
    forced = structured.forced_tool_call(
        list(parsed.tools or ()), parsed.tool_choice, parallel=parsed.parallel_tool_calls
    )
    constraint = structured.request_constraint(controls.output_format(body), forced)
    ignored = [*parsed.ignored, *(key for key in body if key not in READ_FIELDS)]
    return ChatRequest(
        prompt=parsed.prompt(),
        generation=generation,
        stop=stop_strings(stops),
        constraint=constraint,
        cache_points=tuple(parsed.cache_points),
        parallel_tool_calls=parsed.parallel_tool_calls,
        ignored=tuple(dict.fromkeys(ignored)),
    )


def count_request(body: Mapping[str, Any], *, vision: bool = False) -> ChatPrompt:
    """POST /v1/messages/count_tokens: the prompt only (no generation field is read)."""
    parsed = _parse(body, vision)
    if parsed.unsupported is not None:
        raise parsed.unsupported
    return parsed.prompt()


@attrs.define
class _Parsed:
    """A Messages request's prompt part, and the first block the server cannot take (reported
    only after the request's own shape checks)."""

    messages: list[dict[str, Any]] = attrs.Factory(list)
    unsupported: ApiError | None = None  # the first block the server cannot take
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # tool_choice.disable_parallel_tool_use: true → False
    reasoning_kwargs: dict[str, Any] = attrs.Factory(dict)
    effort: str | None = None  # the template's reasoning depth (output_config.effort)
    cache_points: list[CachePoint] = attrs.Factory(list)
    images: list[ImagePart] = attrs.Factory(list)  # in prompt order (api/images.py)
    vision: bool = False  # the model takes images (else an image block is this turn's 400)
    tool_references: set[str] = attrs.Factory(set)  # deferred tools a tool search has loaded
    ignored: list[str] = attrs.Factory(list)  # what the request said that this server does not know

    def mark(self, ttl_s: float | None, messages: list[dict[str, Any]]) -> None:
        """A breakpoint (when `ttl_s` is set) after `messages`, the conversation cut there."""
        if ttl_s is None:
            return
        if len(self.cache_points) == MAX_CACHE_POINTS:
            raise bad_request(f"A maximum of {MAX_CACHE_POINTS} blocks with cache_control may be provided.")
        self.cache_points.append(CachePoint(ttl_s, tuple(messages)))

    def add(self, message: dict[str, Any], unsupported: ApiError | None = None) -> None:
        self.messages.append(message)
        if self.unsupported is None:
            self.unsupported = unsupported

    def ignore(self, name: str) -> None:
        log.debug("anthropic request: ignored %s", name)
        self.ignored.append(name)

    def prompt(self) -> ChatPrompt:
        reasoning = attrs.evolve(reasoning_options(self.reasoning_kwargs, None), effort=self.effort)
        tools = None if self.tool_choice == "none" else self.tools
        return ChatPrompt(messages=tuple(self.messages), tools=tools, reasoning=reasoning, images=tuple(self.images))


def _parse(body: Mapping[str, Any], vision: bool) -> _Parsed:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages: at least one message is required", param="messages")
    parsed = _Parsed(vision=vision)
    system, system_marks = _system_text(body.get("system"))
    for ttl_s, upto in system_marks:
        parsed.mark(ttl_s, [{"role": "system", "content": upto}])
    if system:
        parsed.add({"role": "system", "content": system})
    leading_system = list(parsed.messages)
    kept = controls.thinking_turns_kept(body.get("context_management"), parsed.ignored)
    kept_thinking = controls.kept_thinking_turns(raw_messages, kept)
    for index, message in enumerate(raw_messages):
        _translate_message(message, index, parsed, keep_thinking=index in kept_thinking)
    tools, tools_ttl = _tools(body.get("tools"), parsed)
    parsed.mark(tools_ttl, leading_system)
    raw_choice = body.get("tool_choice")
    choice = _tool_choice(raw_choice, [t["function"]["name"] for t in tools])
    if tools:
        parsed.tools = tuple(tools)
        parsed.tool_choice = choice
        serial = isinstance(raw_choice, Mapping) and raw_choice.get("disable_parallel_tool_use") is True
        parsed.parallel_tool_calls = not serial
    parsed.reasoning_kwargs = controls.thinking_kwargs(body, parsed.ignored)
    parsed.effort = controls.effort(body.get("output_config"), parsed.ignored)
    return parsed


def _system_text(system: Any) -> tuple[str, list[tuple[float, str]]]:
    """The system text, and each breakpoint's (ttl, the system text up to its block)."""
    if system is None:
        return "", []
    if isinstance(system, str):
        return system, []
    if isinstance(system, list):
        texts: list[str] = []
        marks: list[tuple[float, str]] = []
        for index, block in enumerate(system):
            if (
                isinstance(block, Mapping)
                and block.get("type", "text") == "text"
                and isinstance(block.get("text"), str)
            ):
                if block["text"].startswith(BILLING_HEADER):
                    continue
                texts.append(block["text"])
                ttl_s = _cache_ttl(block, f"system.{index}", "system")
                if ttl_s is not None:
                    marks.append((ttl_s, "\n".join(texts)))
            else:
                raise bad_request("system: must be a string or an array of text blocks", param="system")
        return "\n".join(texts), marks
    raise bad_request("system: must be a string or an array of text blocks", param="system")


def _cache_ttl(block: Mapping[str, Any], where: str, param: str) -> float | None:
    """A block's `cache_control` as seconds to retain; None when it has none."""
    control = block.get("cache_control")
    if control is None:
        return None
    if not isinstance(control, Mapping) or control.get("type") != "ephemeral":
        raise bad_request(f"{where}.cache_control.type: must be 'ephemeral'", param=param)
    ttl = control.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in CACHE_TTLS:
        raise bad_request(f"{where}.cache_control.ttl: must be '5m' or '1h'", param=param)
    return CACHE_TTLS[ttl]


def _translate_message(message: Any, index: int, parsed: _Parsed, *, keep_thinking: bool) -> None:
    where = f"messages.{index}"
    if not isinstance(message, Mapping):
        raise bad_request(f"{where}: must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(f"{where}.role: must be 'user', 'assistant' or 'system'", param="messages")
    content = message.get("content")
    if isinstance(content, str):
        parsed.add({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of content blocks", param="messages")

    tool_results: list[dict[str, Any]] = []
    result_wheres: list[str] = []  # each tool result's block, as a 400 names it
    texts: list[str] = []
    thinking: list[str] = []
    has_image = False
    calls: list[dict[str, Any]] = []
    text_marks: list[tuple[float, int]] = []  # (ttl, texts up to the block)
    result_marks: list[tuple[float, int]] = []  # (ttl, tool results up to the block)
    whole_marks: list[float] = []  # any other block: the whole message
    for j, block in enumerate(content):
        block_where = f"{where}.content.{j}"
        if not isinstance(block, Mapping):
            raise bad_request(f"{block_where}: must be an object", param="messages")
        kind = block.get("type")
        if not isinstance(kind, str):
            raise bad_request(f"{block_where}.type: must be a string", param="messages")
        if role == "system" and kind != "text":
            raise bad_request(f"{block_where}: a system message takes text blocks only", param="messages")
        ttl_s = _cache_ttl(block, block_where, "messages")
        if ttl_s is not None:
            if kind in ("text", "document"):
                text_marks.append((ttl_s, len(texts) + 1))
            elif kind == "tool_result":
                result_marks.append((ttl_s, len(tool_results) + 1))
            else:
                whole_marks.append(ttl_s)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{block_where}.text: must be a string", param="messages")
            texts.append(block["text"])
        elif kind == "document":
            texts.append(_document_text(block, block_where))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{block_where}.thinking: must be a string", param="messages")
            if keep_thinking and role == "assistant":
                thinking.append(block["thinking"])
        elif kind == "redacted_thinking":  # encrypted: nothing a template could show
            continue
        elif kind == "image":
            parsed.images.append(_image(block, block_where))
            texts.append(PLACEHOLDER)
            has_image = True
        elif kind == "tool_use":
            calls.append(_tool_call(block, block_where))
        elif kind == "tool_result":
            if block.get("tool_use_id") in (None, ""):
                raise bad_request(f"{block_where}.tool_use_id: Field required", param="messages")
            # Its own role:"tool" message, at the point it appears: before the turn's text.
            tool_results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _tool_result_text(block.get("content"), block_where, parsed),
                }
            )
            result_wheres.append(block_where)
        elif kind in AUDIO_BLOCKS:
            raise bad_request(f"{block_where}: {AUDIO_MESSAGE}", param="messages", code="unsupported_content_type")
        else:  # a block type this server does not know (server tool results, citations, ...)
            parsed.ignore("messages.content.type")

    before_results = len(parsed.messages)
    for result, result_where in zip(tool_results, result_wheres, strict=True):
        bad_id = not isinstance(result["tool_call_id"], str)
        parsed.add(
            result, bad_request(f"{result_where}.tool_use_id: must be a string", param="messages") if bad_id else None
        )
    for ttl_s, count in result_marks:
        parsed.mark(ttl_s, parsed.messages[: before_results + count])
    # Text blocks join with a newline (as `system` does); an image is its placeholder's line
    # (api/images.py); without vision, the turn is a 400.
    unsupported = media_error("image_url") if has_image and not parsed.vision else None
    before = list(parsed.messages)
    if role == "assistant":
        if texts or has_image or calls or thinking:
            assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if thinking:
                assistant["reasoning_content"] = "\n".join(thinking)
            if calls:
                assistant["tool_calls"] = calls
            parsed.add(assistant, unsupported)
    elif role == "system":
        parsed.add({"role": "system", "content": "\n".join(texts)})
    elif texts or has_image or not tool_results:
        parsed.add({"role": "user", "content": "\n".join(texts)}, unsupported)
    for ttl_s, count in text_marks:  # the message's text cut after the marked block
        parsed.mark(ttl_s, [*before, {"role": role, "content": "\n".join(texts[:count])}])
    for ttl_s in whole_marks:
        parsed.mark(ttl_s, parsed.messages)


def _document_text(block: Mapping[str, Any], where: str) -> str:
    """A document block with a plain-text source (`text`, or `content` text blocks); PDF and
    URL sources are a 400 (this server reads no PDF)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "text" and isinstance(source, Mapping) and isinstance(source.get("data"), str):
        return source["data"]
    if kind == "content" and isinstance(source, Mapping):
        if isinstance(source.get("content"), str):
            return source["content"]
        if isinstance(source.get("content"), list):
            blocks = source["content"]
            if all(isinstance(b, Mapping) and isinstance(b.get("text"), str) for b in blocks):
                return "\n".join(b["text"] for b in blocks)
    raise bad_request(
        f"{where}.source: only plain-text documents are supported (a text or content source)", param="messages"
    )


def _image(block: Mapping[str, Any], where: str) -> ImagePart:
    source = block.get("source")
    if isinstance(source, Mapping):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return from_base64(source["data"], source.get("media_type"), "image_url", f"{where}.source", "messages")
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return from_url(source["url"], "image_url", f"{where}.source", "messages")
    raise bad_request(f"{where}.source: an image needs a base64 or url source", param="messages")


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name: a tool_use block needs a name", param="messages")
    arguments = block.get("input", {})
    if not isinstance(arguments, Mapping):  # templates iterate the arguments as an object
        raise bad_request(f"{where}.input: must be an object", param="messages")
    return {"id": block.get("id") or "", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result_text(content: Any, where: str, parsed: _Parsed) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_reference" and isinstance(block.get("tool_name"), str):
                # A tool search's result: the deferred tool it names joins the prompt's tools.
                parsed.tool_references.add(block["tool_name"])
            elif kind in AUDIO_BLOCKS:
                raise bad_request(f"{where}: {AUDIO_MESSAGE}", param="messages", code="unsupported_content_type")
            elif kind in ("image", "document", "text", "tool_reference") or not isinstance(kind, str):
                shown = kind if isinstance(block, Mapping) else type(block).__name__
                raise bad_request(f"{where}.content: unsupported tool_result block {shown!r}", param="messages")
            else:
                parsed.ignore("messages.content.tool_result.type")
        return "\n".join(texts)
    raise bad_request(f"{where}.content: must be a string or an array of blocks", param="messages")


def _tools(tools: Any, parsed: _Parsed) -> tuple[list[dict[str, Any]], float | None]:
    """The client tools, and the longest ttl among the definitions' breakpoints (None: none).
    A deferred tool (`defer_loading`) is in only once a tool_reference has named it."""
    if tools is None:
        return [], None
    if not isinstance(tools, list):
        raise bad_request("tools: must be an array", param="tools")
    out = []
    ttl_s: float | None = None
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        if not isinstance(tool, Mapping):
            raise bad_request(f"{where}: must be an object", param="tools")
        tool_ttl = _cache_ttl(tool, where, "tools")
        if tool_ttl is not None:
            ttl_s = max(ttl_s or 0.0, tool_ttl)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise bad_request(f"{where}.type: must be a string", param="tools")
            parsed.ignore("tools.type")  # a server tool (web_search, bash, ...): the server has none to run
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"{where}.name: {TOOL_NAME_MESSAGE}", param="tools")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise bad_request(f"{where}.input_schema: must be a JSON schema object", param="tools")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.description: must be a string", param="tools")
        deferred = tool.get("defer_loading")
        if deferred is not None and not isinstance(deferred, bool):
            raise bad_request(f"{where}.defer_loading: must be a boolean", param="tools")
        if deferred and name not in parsed.tool_references:
            continue
        function: dict[str, Any] = {"name": name, "parameters": dict(tool["input_schema"])}
        if description is not None:
            function["description"] = description
        if tool.get("strict") is True:  # its input follows the schema (api/structured.py)
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out, ttl_s


def _tool_choice(choice: Any, names: list[str]) -> Any:
    """tool_choice in OpenAI's terms (None when absent): "auto", "required" (Anthropic's "any"),
    "none" (the tools dropped) or a named function. `names`: the client tools' names; a forced
    call needs one of them."""
    if choice is None:
        return None
    if not isinstance(choice, Mapping):
        raise bad_request("tool_choice: must be an object with a type", param="tool_choice")
    kind = choice.get("type")
    if not isinstance(kind, str) or (kind not in TOOL_CHOICES and kind != "tool"):
        raise bad_request(f"{TOOL_CHOICE_MESSAGE}, got {kind!r}", param="tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: must be a boolean", param="tool_choice")
    if kind in ("any", "tool") and not names:
        raise bad_request(f"tool_choice {kind!r} forces a tool call, but no client tool is given", param="tool_choice")
    if kind != "tool":
        return TOOL_CHOICES[kind]
    name = choice.get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice.name: must be a string", param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice.name: {name!r} is not in tools", param="tool_choice")
    return {"type": "function", "function": {"name": name}}
