"""The generation core the protocols share: a typed request in, an admitted generation out.

`start_chat` applies the server's defaults (sampling, max_tokens) under the request's own
fields, cools a no-think turn, renders the chat template, picks the tool-call format, builds a
forced tool call's grammar in that format, finds the boundary-snapshot position, builds the
text pipeline (`CompletionSink`) and admits the generation through a `RequestActor` — so 400 /
503 are real HTTP statuses, answered before any byte of the response. `start_text` is the same
for a raw prompt (no template, tools or reasoning split). `prompt_token_count` renders exactly
what `start_chat` would, for count_tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from actors.handles import ServerHandles
from actors.messages import GenerationRequest
from actors.request import RequestActor, RequestRejected
from api.chat_request import ChatPrompt, ChatRequest, GenerationFields, TextRequest
from api.errors import bad_request, from_rejection
from api.pipeline.events import Event
from api.pipeline.sink import CompletionSink
from api.pipeline.think import prompt_ends_in_open_think
from api.pipeline.tools.detect import detect_tool_format
from api.structured import ConstraintRequest
from cache.boundary import stable_prefix_length
from model.params import SamplingParams
from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHAT_DEFAULT_MAX_TOKENS = 65_536
TEXT_DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's: an untemplated prompt may never reach EOS
NO_THINK_TEMPERATURE_CAP = 0.7  # a no-think turn runs cooler unless the request names a temperature
# Used when tools are present but neither the template nor the family names a format: the
# `<tool_call>{json}</tool_call>` convention is what most templates teach.
FALLBACK_TOOL_FORMAT = "hermes"


@attrs.frozen
class Generation:
    """The generation as it runs: the request's fields over the server's defaults."""

    sampling: SamplingParams  # logprobs / top_logprobs set only when they will be captured
    max_tokens: int
    explicit_seed: bool
    seed: int | None
    stream: bool

    @property
    def captures_logprobs(self) -> bool:
        return bool(self.sampling.logprobs or self.sampling.top_logprobs)


def resolve_generation(
    fields: GenerationFields,
    *,
    defaults: SamplingParams,
    default_max_tokens: int,
    constraint: ConstraintRequest | None = None,
    tool_format: str | None = None,
) -> Generation:
    """Request > server defaults (flags over generation_config.json over the fallback)."""
    capture = not fields.stream and (fields.logprobs or fields.top_logprobs > 0)  # streams never carry logprobs
    sampling = attrs.evolve(
        fields.sampling.apply(defaults),
        logprobs=bool(capture and fields.logprobs),
        top_logprobs=fields.top_logprobs if capture else 0,
        constraint=None if constraint is None else constraint.for_tool_format(tool_format),
    )
    return Generation(
        sampling=sampling,
        max_tokens=fields.max_tokens or default_max_tokens,
        explicit_seed=fields.explicit_seed,
        seed=fields.seed,
        stream=fields.stream,
    )


@attrs.frozen(eq=False)
class StartedGeneration:
    """An admitted generation: the actor yields text events; the caller must close it."""

    actor: RequestActor[Event]
    generation: Generation
    prompt: tuple[int, ...]


@attrs.frozen
class RenderedPrompt:
    tokens: list[int]
    text: str | None  # the rendered template, when the tokenizer can show it
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]


def render_prompt(tokenizer: Tokenizer, prompt: ChatPrompt) -> RenderedPrompt:
    """The chat template applied to the prompt. A template error is a 400."""
    tools = list(prompt.tools) if prompt.tools else None
    kwargs = prompt.reasoning.template_kwargs()
    if "reasoning_effort" in kwargs and "reasoning_effort" not in (_template_source(tokenizer, tools) or ""):
        del kwargs["reasoning_effort"]  # only templates that read a depth get one
    messages = list(prompt.messages)
    try:
        render = getattr(tokenizer, "render_chat", None)
        if render is None:
            tokens = tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True, **kwargs)
            return RenderedPrompt(tokens, None, tools, kwargs)
        text = render(messages, tools=tools, add_generation_prompt=True, **kwargs)
        return RenderedPrompt(tokenizer.encode(text, add_special_tokens=True), text, tools, kwargs)
    except Exception as exc:  # template errors are the client's messages, not a crash
        log.debug("prompt build failed", exc_info=True)
        raise bad_request(f"prompt build failed: {exc}") from exc


def prompt_token_count(tokenizer: Tokenizer, prompt: ChatPrompt) -> int:
    """The length of the prompt `start_chat` renders for `prompt` (tokenizer only)."""
    return len(render_prompt(tokenizer, prompt).tokens)


async def start_chat(handles: ServerHandles, request: ChatRequest) -> StartedGeneration:
    """Template and admit a chat request. Raises `ApiError` (400 / 503)."""
    tokenizer = handles.tokenizer
    fields = request.generation
    reasoning = request.prompt.reasoning
    if (
        reasoning.enable_thinking is False
        and fields.sampling.temperature is None
        and handles.sampling_defaults.temperature > NO_THINK_TEMPERATURE_CAP
    ):
        fields = attrs.evolve(fields, sampling=attrs.evolve(fields.sampling, temperature=NO_THINK_TEMPERATURE_CAP))
    rendered = render_prompt(tokenizer, request.prompt)
    think = bool(getattr(tokenizer, "has_thinking", False))
    # A template that pre-fills `<think>` (Qwen3 thinking, DeepSeek-R1) starts generation inside
    # reasoning.
    starts_in_reasoning = rendered.text is not None and prompt_ends_in_open_think(rendered.text)
    tool_format = _tool_format(handles, rendered.tools) if rendered.tools else None
    generation = resolve_generation(
        fields,
        defaults=handles.sampling_defaults,
        default_max_tokens=handles.config.max_tokens or CHAT_DEFAULT_MAX_TOKENS,
        constraint=request.constraint,
        tool_format=tool_format,
    )
    sink = CompletionSink(
        tokenizer.detokenizer(),
        stop=request.stop,
        think=think or starts_in_reasoning,
        starts_in_reasoning=starts_in_reasoning,
        tool_format=tool_format,
        tools_present=tool_format is not None,
    )
    snapshot_at = _snapshot_position(handles, request.prompt, rendered)
    return await _admitted(handles, rendered.tokens, generation, sink, snapshot_at=snapshot_at)


async def start_text(handles: ServerHandles, request: TextRequest) -> StartedGeneration:
    """Admit a raw-prompt completion. Raises `ApiError` (400 / 503)."""
    tokenizer = handles.tokenizer
    prompt = tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
    generation = resolve_generation(
        request.generation,
        defaults=handles.sampling_defaults,
        default_max_tokens=handles.config.max_tokens or TEXT_DEFAULT_MAX_TOKENS,
        constraint=request.constraint,
    )
    sink = CompletionSink(tokenizer.detokenizer(), stop=request.stop)
    return await _admitted(handles, prompt, generation, sink)


def vocab_size(tokenizer: Tokenizer) -> int | None:
    """The tokenizer's vocabulary size, when it has one (bounds token ids in requests)."""
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _template_source(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None) -> str | None:
    try:
        source = tokenizer.chat_template(tools=tools).source
    except Exception:  # no template, or a tokenizer double without one
        return None
    return source if isinstance(source, str) else None


def _tool_format(handles: ServerHandles, tools: list[dict[str, Any]]) -> str:
    source = _template_source(handles.tokenizer, tools)
    return detect_tool_format(source, handles.info.model_type) or FALLBACK_TOOL_FORMAT


def _snapshot_position(handles: ServerHandles, prompt: ChatPrompt, rendered: RenderedPrompt) -> int | None:
    """Where the next turn's prompt stops agreeing with this one: the boundary snapshot."""
    if handles.prompt_cache is None:
        return None
    try:
        position = stable_prefix_length(
            handles.tokenizer,
            list(prompt.messages),
            prompt_tokens=rendered.tokens,
            tools=rendered.tools,
            **rendered.template_kwargs,
        )
    except Exception:  # a probe failure costs a cache miss, never the request
        log.debug("stable prefix probe failed", exc_info=True)
        return None
    return position or None


async def _admitted(
    handles: ServerHandles,
    prompt: list[int],
    generation: Generation,
    sink: CompletionSink,
    *,
    snapshot_at: int | None = None,
) -> StartedGeneration:
    request = GenerationRequest(
        prompt=tuple(prompt),
        sampling=generation.sampling,
        max_tokens=generation.max_tokens,
        explicit_seed=generation.explicit_seed,
        seed=generation.seed,
        snapshot_at=snapshot_at,
    )
    actor = RequestActor(handles.ports, request, sink)
    try:
        await actor.admit()
    except RequestRejected as rejected:
        raise from_rejection(rejected.rejection) from None
    except BaseException:
        actor.close()
        raise
    return StartedGeneration(actor=actor, generation=generation, prompt=request.prompt)
