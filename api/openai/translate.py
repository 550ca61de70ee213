"""OpenAI chat-completions and completions bodies → the typed requests of api/chat_request.py.

Every invalid field is a 400 in the OpenAI error shape, never a 500. Fields are read in a fixed
order (messages, generation fields, structured output, stop, tools, reasoning), so a body with
several bad fields always names the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from api import structured
from api.cache_hints import cache_hints, retention_points
from api.chat_request import ChatPrompt, ChatRequest, TextRequest
from api.errors import bad_request
from api.fields import MAX_INT, MAX_TOP_LOGPROBS, flag, integer, parse_generation, pick, reasoning_options, stop_strings
from api.images import PLACEHOLDER, PLACEHOLDERS, ImagePart, from_part, from_url
from api.template_messages import MEDIA_PARTS, media_error, template_arguments, tool_call_id_error

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
TOOL_CHOICE_MESSAGE = "tool_choice must be 'none', 'auto', 'required' or an object"
_LOGPROBS_RANGE = f"an integer from 0 to {MAX_TOP_LOGPROBS} on /v1/completions (the alternatives listed per token)"
_PROMPT_REQUIRED = "prompt (a non-empty string) or a non-empty array of token ids is required (one prompt per request)"


def chat_request(body: Mapping[str, Any], *, vocab_size: int | None, vision: bool = False) -> ChatRequest:
    """/v1/chat/completions. `vocab_size`, when known, bounds `logit_bias` token ids; `vision`:
    the model takes images (else an image part is a 400)."""
    images: list[ImagePart] = []
    messages = chat_messages(body.get("messages"), images if vision else None)
    generation = attrs.evolve(parse_generation(body, vocab_size=vocab_size), include_usage=include_usage(body))
    if generation.top_logprobs > 0 and not generation.logprobs:  # OpenAI's rule
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    constraint = structured.body_constraint(body)
    stop = stop_strings(body.get("stop"))
    tools = tools_field(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) or choice in TOOL_CHOICES):
        raise bad_request(TOOL_CHOICE_MESSAGE, param="tool_choice")
    if not tools and (choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function")):
        # with tools, a named function that is not among them is structured.forced_tool_call's 400
        raise bad_request("tool_choice requires tools: the request has none", param="tool_choice")
    # "auto", "required" and named functions only steer (a forced call is a grammar, where one runs).
    disabled = choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")
    reasoning = reasoning_options(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
    tools_on = None if disabled or not tools else tuple(tools)
    prompt = ChatPrompt(messages=messages, tools=tools_on, reasoning=reasoning, images=tuple(images))
    hints = cache_hints(body)
    return ChatRequest(
        prompt=prompt,
        generation=generation,
        stop=stop,
        constraint=constraint,
        parallel_tool_calls=flag(body.get("parallel_tool_calls"), "parallel_tool_calls") is not False,
        cache_points=retention_points(messages, hints),
        cache_key=hints.key,
    )


def text_request(body: Mapping[str, Any], *, vocab_size: int | None) -> TextRequest:
    """/v1/completions: one raw prompt (a string or token ids), no template. `logprobs` is the
    legacy API's integer (the alternatives listed per token), not chat's boolean."""
    prompt = _text_prompt(body.get("prompt"), vocab_size)
    chat_fields = pick(body, ("logprobs", "top_logprobs"))
    fields = {k: v for k, v in body.items() if k not in chat_fields}
    if not completion_output(body).generate:
        del fields["max_tokens"]  # 0: the prompt's scores alone (api/openai/prompt_logprobs.py)
    generation = parse_generation(fields, vocab_size=vocab_size)
    _check_unsupported_completion_fields(body, generation.n)
    alternatives = completion_logprobs(body)
    generation = attrs.evolve(
        generation,
        include_usage=include_usage(body),
        logprobs=alternatives is not None,
        top_logprobs=alternatives or 0,
    )
    constraint = structured.body_constraint(body)
    return TextRequest(prompt=prompt, generation=generation, stop=stop_strings(body.get("stop")), constraint=constraint)


def _check_unsupported_completion_fields(body: Mapping[str, Any], n: int) -> None:
    """`suffix` (insertion) and `best_of` (ranking candidates) would change the answer, so a
    request that needs them is refused rather than answered without them (vLLM refuses suffix)."""
    suffix = body.get("suffix")
    if suffix is not None and suffix != "":
        raise bad_request("suffix is not supported: the server only appends to the prompt", param="suffix")
    best_of = integer(body.get("best_of"), "best_of", minimum=1, what=f"a positive integer (at most {MAX_INT})")
    if best_of is not None and best_of not in (1, n):
        raise bad_request(
            f"best_of is not supported: the server does not rank candidate completions (omit it, or set it to "
            f"1 or to n = {n})",
            param="best_of",
        )


def completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """/v1/completions `logprobs`: None (not asked) or how many alternatives each token lists.
    A boolean is chat's form, and `top_logprobs` chat's field: both are a 400 here."""
    top = body.get("top_logprobs")
    if top is not None and not (top == -1 and not isinstance(top, bool)):  # -1: mlx-lm's "unset"
        raise bad_request(
            "top_logprobs is a chat completions field: on /v1/completions, logprobs is the number of alternatives",
            param="top_logprobs",
        )
    return integer(body.get("logprobs"), "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS, what=_LOGPROBS_RANGE)


@attrs.frozen
class CompletionOutput:
    """How /v1/completions answers: `echo`, the prompt's text before the completion's;
    `token_ids` (vLLM's `return_tokens_as_token_ids`), logprobs name tokens "token_id:<id>";
    `prompt_logprobs`, echo with logprobs: the prompt's tokens scored, with that many
    alternatives each (api/openai/prompt_logprobs.py); `generate` False for `max_tokens: 0`
    with them: the prompt's scores alone."""

    echo: bool = False
    token_ids: bool = False
    prompt_logprobs: int | None = None
    generate: bool = True


def completion_output(body: Mapping[str, Any]) -> CompletionOutput:
    for name in ("echo", "return_tokens_as_token_ids"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean", param=name)
    echo = bool(body.get("echo"))
    scored = completion_logprobs(body) if echo else None
    max_tokens = body.get("max_tokens")
    scores_only = scored is not None and max_tokens == 0 and not isinstance(max_tokens, bool)
    return CompletionOutput(
        echo=echo,
        token_ids=bool(body.get("return_tokens_as_token_ids")),
        prompt_logprobs=scored,
        generate=not scores_only,
    )


def _text_prompt(value: Any, vocab_size: int | None) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a one-element batch is that prompt
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = next((t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is out of range (vocabulary size {vocab_size})", param="prompt")
        return tuple(value)
    raise bad_request(_PROMPT_REQUIRED, param="prompt")


def tools_field(tools: Any) -> list[Any] | None:
    if tools is None:
        return None
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
    return tools


# --- messages ----------------------------------------------------------------------------------


def chat_messages(messages: Any, images: list[ImagePart] | None = None) -> tuple[dict[str, Any], ...]:
    """OpenAI messages → what chat templates read. The body is never mutated.

    `developer` becomes `system`; text part arrays flatten to one string; assistant
    `tool_calls[].function.arguments` JSON strings are parsed to objects (templates iterate or
    `tojson` them); an `image_url` part becomes the image placeholder in the text and an entry of
    `images` (api/images.py: a model without vision answers 400 there); other media parts, and
    images when `images` is None, are a clear 400.
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages required", param="messages")
    return tuple(_chat_message(message, f"messages[{i}]", images) for i, message in enumerate(messages))


def _chat_message(message: Any, where: str, images: list[ImagePart] | None) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", param="messages")
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        roles = ", ".join(f"'{r}'" for r in MESSAGE_ROLES)
        raise bad_request(f"{where}.role must be one of {roles}", param="messages")
    if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
        # (null is taken as empty text, as mlx_lm.server takes it; a missing key is a malformed message)
        raise bad_request(f"{where}.content is required", param="messages")
    out = dict(message)
    if role == "developer":
        out["role"] = "system"
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", param="messages")
        out["tool_calls"] = _history_tool_calls(tool_calls, f"{where}.tool_calls")
    content = _flat_content(message.get("content"), f"{where}.content", images)
    # null content (an assistant turn that only called tools) stays absent for the template;
    # anywhere else it is an empty string, as in mlx_lm.server.
    out["content"] = None if content is None and out.get("tool_calls") else (content or "")
    if role == "tool" and message.get("tool_call_id") is None:
        raise bad_request(f"{where}.tool_call_id is required (the id of the call it answers)", param="messages")
    if role == "tool" and not isinstance(message["tool_call_id"], str):
        raise tool_call_id_error(where)
    return out


def _flat_content(content: Any, where: str, images: list[ImagePart] | None = None) -> str | None:
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
        if kind == "image_url" and images is not None:
            url = part.get("image_url")
            images.append(from_url(url.get("url") if isinstance(url, dict) else url, kind, where, "messages"))
            texts.append(PLACEHOLDER)
            continue
        media = from_part(part, kind, where, "messages") if images is not None else None
        if images is not None and media is not None:  # a video or audio part (api/images.py)
            images.append(media)
            texts.append(PLACEHOLDERS[media.media])
            continue
        if kind in MEDIA_PARTS:
            raise media_error(kind)
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
        arguments = template_arguments(function.get("arguments"))
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def include_usage(body: Mapping[str, Any]) -> bool:
    """`stream_options.include_usage`: the stream ends with a usage chunk (`choices: []`).
    Ignored without `stream`, as OpenAI's stream options are."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise bad_request("stream_options.include_usage must be a boolean", param="stream_options")
    return bool(value)
