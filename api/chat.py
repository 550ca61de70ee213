"""The generation core the protocols share: a typed request in, an admitted generation out.

`start_chat` applies the server's defaults (sampling, max_tokens) under the request's own
fields, cools a no-think turn, renders the chat template, picks the tool-call format, builds a
forced tool call's grammar in that format, finds the boundary-snapshot position and the
positions of the client's cache breakpoints (retention hints), builds the
text pipeline (`CompletionSink`) and admits the generation through a `RequestActor` — so 400 /
503 are real HTTP statuses, answered before any byte of the response. `start_text` is the same
for a raw prompt (no template, tools or reasoning split). `prompt_token_count` renders exactly
what `start_chat` would, for count_tokens.

Everything before admission (the size bound, templating, tokenizing, the stable-prefix probe)
is `prepare_chat` / `prepare_text`, run on a worker thread unless the body was small
(api/http/offload.py): on a large prompt it takes seconds the event loop's streams must not wait.
The constraint the row will run is then compiled for the model's tokenizer, always on a thread
(a short regex can take half a second), so a grammar the engine cannot run is a 400 now.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import attrs
import numpy as np

from actors.handles import ServerHandles
from actors.messages import GenerationRequest, Siblings
from actors.request import RequestActor, RequestRejected
from api import images, media, prompt_bounds
from api.cache_hints import key_namespace
from api.chat_request import ChatPrompt, ChatRequest, GenerationFields, TextRequest
from api.errors import ApiError, bad_request, from_rejection
from api.fields import MAX_CHOICES
from api.http import offload
from api.observability.request_log import note_ignored, note_templating
from api.pipeline.events import Event
from api.pipeline.sink import CompletionSink
from api.pipeline.think import prompt_ends_in_open_think
from api.pipeline.tools.detect import detect_tool_format
from api.structured import ConstraintRequest, check_compiles, compiles_for
from api.template_messages import join_late_system, late_system_texts
from api.thinking import row_think_control
from cache.boundary import stable_prefix_length
from cache.prefix_match import common_prefix_length
from model.engine.params import SamplingParams, ThinkControl
from model.engine.rows import ImageInput
from model.text.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

CHAT_DEFAULT_MAX_TOKENS = 65_536
TEXT_DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's: an untemplated prompt may never reach EOS
NO_THINK_TEMPERATURE_CAP = 0.7  # a no-think turn runs cooler unless the request names a temperature
PROMPT_TAIL_TOKENS = 8  # a token-id prompt's last tokens, decoded to see whether it ends inside reasoning
# Used when tools are present but neither the template nor the family names a format: the
# `<tool_call>{json}</tool_call>` convention is what most templates teach.
FALLBACK_TOOL_FORMAT = "hermes"


@attrs.frozen
class Generation:
    """The generation as it runs: the request's fields over the server's defaults."""

    sampling: SamplingParams  # logprobs / top_logprobs as asked: the row captures them
    max_tokens: int
    seed: int | None
    stream: bool
    n: int = 1  # choices, each its own row, sharing one prefill

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
    """Request > server defaults (flags over generation_config.json over the fallback). Logprobs
    are captured whenever asked, streamed or not: only chat and completions ask (their answers
    and streams carry them); Messages and Responses never pass them."""
    sampling = attrs.evolve(
        fields.sampling.apply(defaults),
        logprobs=fields.logprobs,
        top_logprobs=fields.top_logprobs,
        constraint=None if constraint is None else constraint.for_tool_format(tool_format),
    )
    return Generation(
        sampling=sampling,
        max_tokens=fields.max_tokens or default_max_tokens,
        seed=fields.seed,
        stream=fields.stream,
        n=fields.n,
    )


@attrs.frozen(eq=False)
class StartedGeneration:
    """An admitted generation: one actor per choice (`n`), each yielding its text events; the
    caller must close them all."""

    choices: tuple[RequestActor[Event], ...]
    generation: Generation
    prompt: tuple[int, ...]

    @property
    def actor(self) -> RequestActor[Event]:
        """The first choice: the only one where the protocol has no `n`."""
        return self.choices[0]


@attrs.frozen
class RenderedPrompt:
    tokens: list[int]
    text: str | None  # the rendered template, when the tokenizer can show it
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    messages: tuple[dict[str, Any], ...] = ()  # the messages rendered
    joined_system: bool = False  # mid-conversation system messages were joined to the system prompt


def render_prompt(tokenizer: ChatTokenizer, prompt: ChatPrompt, *, generation_prompt: bool = True) -> RenderedPrompt:
    """The chat template applied to the prompt (`generation_prompt`: with the assistant turn's
    opening, as generation needs). A template error is a 400.

    A system message after the first message is rendered where it is when the template can; a
    template that raises on it, or leaves its text out, gets it joined to the system prompt
    instead (`join_late_system`)."""
    tools = list(prompt.tools) if prompt.tools else None
    kwargs = prompt.reasoning.template_kwargs()
    if "reasoning_effort" in kwargs and "reasoning_effort" not in (_template_source(tokenizer, tools) or ""):
        del kwargs["reasoning_effort"]  # only templates that read a depth get one
    messages = list(prompt.messages)
    late = late_system_texts(messages)
    try:
        rendered: RenderedPrompt | None = None
        try:
            rendered = _render(tokenizer, messages, tools, kwargs, generation_prompt)
        except Exception:
            if not late:
                raise
            log.debug("template refused a mid-conversation system message; joining it to the system prompt")
        if late and (rendered is None or not _shows_all(rendered.text, late)):
            joined = join_late_system(messages)
            return _render(tokenizer, joined, tools, kwargs, generation_prompt, joined_system=True)
        assert rendered is not None
        return rendered
    except Exception as exc:  # template errors are the client's messages, not a crash
        log.debug("prompt build failed", exc_info=True)
        raise bad_request(f"prompt build failed: {exc}") from exc


def _render(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    generation_prompt: bool = True,
    *,
    joined_system: bool = False,
) -> RenderedPrompt:
    text = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=generation_prompt, **kwargs)
    tokens = tokenizer.encode(text, add_special_tokens=True)
    return RenderedPrompt(tokens, text, tools, kwargs, tuple(messages), joined_system)


def _shows_all(text: str | None, system_texts: list[str]) -> bool:
    """Whether a rendered prompt holds every one of `system_texts` (unknown without the text)."""
    return text is None or all(t.strip() in text for t in system_texts)


def render_chat_prompt(handles: ServerHandles, prompt: ChatPrompt, *, generation_prompt: bool = True) -> RenderedPrompt:
    """What the chat routes render for `prompt`, once it passes the size bound (blocking; the
    utilities' /tokenize and /apply-template). Raises `ApiError` (400)."""
    check_prompt_size(handles, prompt)
    return render_prompt(
        handles.tokenizer, prompt.with_defaults(handles.options.templates), generation_prompt=generation_prompt
    )


def prompt_token_count(handles: ServerHandles, prompt: ChatPrompt) -> int:
    """The length of the prompt `start_chat` renders for `prompt` (tokenizer only; blocking).
    Raises `ApiError` (400) for a prompt that cannot fit the context window."""
    check_prompt_size(handles, prompt)
    prompt = images.localized(prompt, handles.info, handles.tokenizer)  # (the model's media placeholders)
    prompt = prompt.with_defaults(handles.options.templates)
    tokens = render_prompt(handles.tokenizer, prompt).tokens
    if prompt.images:  # each image counts its grid's tokens, read from its header (nothing decoded)
        return images.expanded_length(
            tokens, images.plan_images(prompt.images, handles.info, handles.tokenizer), handles.info, prompt.param
        )
    return len(tokens)


def check_prompt_size(handles: ServerHandles, prompt: ChatPrompt) -> None:
    """The cheap bound (api/prompt_bounds.py), before any templating."""
    prompt_bounds.check_chars(
        prompt_bounds.message_chars(prompt.messages),
        tokenizer=handles.tokenizer,
        context_length=handles.info.context_length,
        param=prompt.param,
    )


@attrs.frozen(eq=False)
class PreparedChat:
    """A request ready for admission: its prompt ids, generation, text pipeline, snapshot."""

    tokens: list[int]
    generation: Generation
    sink: CompletionSink
    snapshot_at: int | None = None
    retain: tuple[tuple[int, float], ...] = ()  # (prompt position, seconds): the cache breakpoints


async def start_chat(
    handles: ServerHandles, request: ChatRequest, *, adapters: tuple[str, ...] = ()
) -> StartedGeneration:
    """Template and admit a chat request (`adapters`: the LoRA adapters its rows stack, checked
    mounted by the route). Raises `ApiError` (400 / 503)."""
    note_templating()
    note_ignored(request.ignored)
    parts = request.prompt.images
    # Images are judged from their headers before anything else (a 400 first on a text model),
    # and the prompt with their tokens must fit before one is decoded (api/media.py decodes them).
    plans = await offload.to_thread(images.plan_images, parts, handles.info, handles.tokenizer) if parts else ()
    prepared = await offload.run(prepare_chat, handles, request)
    if parts:
        await offload.run(_check_image_fit, handles, prepared.tokens, plans, parts[0].param)
    await _check_constraint(handles, request.constraint, prepared.generation)
    async with media.decoded(handles, parts, plans) as inputs:  # billed until the row opens
        if inputs:  # (a walk over the whole prompt: off the event loop for a large one)
            prepared = await offload.run(_with_images, handles, prepared, inputs, plans, parts[0].param)
        return await _admitted(
            handles,
            prepared.tokens,
            prepared.generation,
            prepared.sink,
            snapshot_at=prepared.snapshot_at,
            retain=prepared.retain,
            adapters=adapters,
            images=inputs,
            namespace=key_namespace(request.cache_key) if handles.options.caches.prompt_cache_key_isolation else "",
        )


def _check_image_fit(
    handles: ServerHandles, tokens: list[int], plans: tuple[images.ImagePlan, ...], param: str
) -> None:
    """400 when the prompt with each image's tokens (from its header) cannot fit the window."""
    length = images.expanded_length(tokens, plans, handles.info, param)
    prompt_bounds.check_tokens(length, context_length=handles.info.context_length, param=param)


def _with_images(
    handles: ServerHandles,
    prepared: PreparedChat,
    inputs: tuple[ImageInput, ...],
    plans: tuple[images.ImagePlan, ...],
    param: str,
) -> PreparedChat:
    """The prompt with each image's pad token grown to its grid; cache positions moved along."""
    tokens, moved = images.expand(prepared.tokens, inputs, plans, handles.info, param)
    prompt_bounds.check_tokens(len(tokens), context_length=handles.info.context_length, param=param)
    snapshot_at = None if prepared.snapshot_at is None else moved(prepared.snapshot_at)
    retain = tuple((moved(at), ttl_s) for at, ttl_s in prepared.retain)
    return attrs.evolve(prepared, tokens=tokens, snapshot_at=snapshot_at, retain=retain)


def prepare_chat(handles: ServerHandles, request: ChatRequest) -> PreparedChat:
    """Everything `start_chat` does before admission (blocking). Raises `ApiError` (400)."""
    check_prompt_size(handles, request.prompt)
    request = attrs.evolve(request, prompt=images.localized(request.prompt, handles.info, handles.tokenizer))
    request = attrs.evolve(request, prompt=request.prompt.with_defaults(handles.options.templates))
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
    prompt_bounds.check_tokens(
        len(rendered.tokens), context_length=handles.info.context_length, param=request.prompt.param
    )
    think = tokenizer.has_thinking
    # A template that pre-fills `<think>` (Qwen3 thinking, DeepSeek-R1) starts generation inside
    # reasoning.
    starts_in_reasoning = rendered.text is not None and prompt_ends_in_open_think(rendered.text)
    tool_format = _tool_format(handles, rendered.tools) if rendered.tools else None
    generation = resolve_generation(
        fields,
        defaults=handles.sampling_defaults,
        default_max_tokens=handles.options.sampling.max_tokens or CHAT_DEFAULT_MAX_TOKENS,
        constraint=request.constraint,
        tool_format=tool_format,
    )
    thinking, constrained = reasoning.enable_thinking, generation.sampling.constraint is not None
    control = row_think_control(handles, fields.thinking_budget, starts_in_reasoning, constrained, thinking=thinking)
    generation = _with_think(generation, control)
    sink = CompletionSink(
        tokenizer.detokenizer(),
        stop=request.stop,
        think=think or starts_in_reasoning,
        starts_in_reasoning=starts_in_reasoning,
        tool_format=tool_format,
        tools_present=tool_format is not None,
        parallel_tool_calls=request.parallel_tool_calls,
    )
    snapshot_at = _snapshot_position(handles, request.prompt, rendered)
    return PreparedChat(rendered.tokens, generation, sink, snapshot_at, _retained_positions(handles, request, rendered))


async def start_text(
    handles: ServerHandles, request: TextRequest, *, adapters: tuple[str, ...] = ()
) -> StartedGeneration:
    """Admit a raw-prompt completion. Raises `ApiError` (400 / 503)."""
    note_templating()
    prepared = await offload.run(prepare_text, handles, request)
    await _check_constraint(handles, request.constraint, prepared.generation)
    return await _admitted(handles, prepared.tokens, prepared.generation, prepared.sink, adapters=adapters)


def prepare_text(handles: ServerHandles, request: TextRequest) -> PreparedChat:
    """Everything `start_text` does before admission (blocking). Raises `ApiError` (400)."""
    tokenizer = handles.tokenizer
    prompt = text_prompt_tokens(handles, request)
    generation = resolve_generation(
        request.generation,
        defaults=handles.sampling_defaults,
        default_max_tokens=handles.options.sampling.max_tokens or TEXT_DEFAULT_MAX_TOKENS,
        constraint=request.constraint,
    )
    tail = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:])
    constrained = generation.sampling.constraint is not None
    starts = prompt_ends_in_open_think(tail)
    generation = _with_think(
        generation, row_think_control(handles, request.generation.thinking_budget, starts, constrained)
    )
    sink = CompletionSink(tokenizer.detokenizer(), stop=request.stop)
    return PreparedChat(prompt, generation, sink)


def _with_think(generation: Generation, control: ThinkControl | None) -> Generation:
    return attrs.evolve(generation, sampling=attrs.evolve(generation.sampling, think=control))


def text_prompt_tokens(handles: ServerHandles, request: TextRequest) -> list[int]:
    """A raw prompt's token ids, once it fits the context window (blocking). Raises `ApiError`."""
    context = handles.info.context_length
    return prompt_bounds.text_tokens(request.prompt, tokenizer=handles.tokenizer, context_length=context)


async def _check_constraint(handles: ServerHandles, request: ConstraintRequest | None, generation: Generation) -> None:
    """The constraint the row will run, compiled for the model's tokenizer now (400 if it cannot
    run), so no row starts with a grammar the engine would drop."""
    constraint = generation.sampling.constraint
    if request is not None and compiles_for(handles.tokenizer, constraint):
        await offload.to_thread(check_compiles, handles.tokenizer, constraint, request.param)


def vocab_size(tokenizer: ChatTokenizer) -> int | None:
    """The tokenizer's vocabulary size, when it has one (bounds token ids in requests)."""
    size = tokenizer.vocab_size
    return size if size is not None and size > 0 else None


def _template_source(tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None) -> str | None:
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
            list(rendered.messages),
            prompt_tokens=rendered.tokens,
            tools=rendered.tools,
            **rendered.template_kwargs,
        )
    except Exception:  # a probe failure costs a cache miss, never the request
        log.debug("stable prefix probe failed", exc_info=True)
        return None
    return position or None


def _retained_positions(
    handles: ServerHandles, request: ChatRequest, rendered: RenderedPrompt
) -> tuple[tuple[int, float], ...]:
    """Each cache breakpoint as a prompt position: the token prefix the prompt shares with the
    conversation cut at the breakpoint, rendered without a generation prompt (its closing tokens
    differ from what follows in the prompt, so the shared part ends at the cut, or a token or two
    before it where the tokenizer merges across). A breakpoint that cannot be rendered is dropped:
    a wrong position could only cost a cache miss (keys are exact token tuples)."""
    if handles.prompt_cache is None or not request.cache_points:
        return ()
    prompt = np.asarray(rendered.tokens, np.int64)
    positions: dict[int, float] = {}
    for point in request.cache_points:
        cut_messages = join_late_system(point.messages) if rendered.joined_system else list(point.messages)
        try:
            cut = handles.tokenizer.encode_chat(
                cut_messages, tools=rendered.tools, add_generation_prompt=False, **rendered.template_kwargs
            )
        except Exception:  # a template that rejects the cut (role alternation, say): no hint
            log.debug("cache breakpoint render failed", exc_info=True)
            continue
        at = common_prefix_length(prompt, np.asarray(cut, np.int64))
        if at > 0:
            positions[at] = max(positions.get(at, 0.0), point.ttl_s)
    return tuple(sorted(positions.items()))


async def _admitted(
    handles: ServerHandles,
    prompt: list[int],
    generation: Generation,
    sink: CompletionSink,
    *,
    snapshot_at: int | None = None,
    retain: tuple[tuple[int, float], ...] = (),
    adapters: tuple[str, ...] = (),
    images: tuple[ImageInput, ...] = (),
    namespace: str = "",
) -> StartedGeneration:
    """Admit every choice: each its own actor (text pipeline, row, abort), siblings in the
    scheduler, which prefills the prompt once for all of them. All or none: a rejection closes
    the choices already admitted."""
    failure = handles.worker_failure()
    if failure is not None:  # an isolated engine that failed for good: a 503 before a stream starts
        raise ApiError(503, f"generation failed: the model {handles.info.name} failed: {failure}")
    n = generation.n
    limit = max_choices(handles)
    if n > limit:
        raise bad_request(f"n must be at most {limit} on this server (the rows it decodes at once)", param="n")
    family = next(_FAMILIES) if n > 1 else None
    actors: list[RequestActor[Event]] = []
    try:
        for index in range(n):
            request = GenerationRequest(
                prompt=tuple(prompt),
                sampling=generation.sampling,
                max_tokens=generation.max_tokens,
                # An explicit seed gives choice i seed + i: reproducible, and the choices differ.
                seed=None if generation.seed is None else (generation.seed + index) & 0xFFFFFFFF,
                snapshot_at=snapshot_at,
                retain=retain,
                namespace=namespace,
                siblings=None if family is None else Siblings(family, index, n),
                adapters=adapters,
                images=images,
            )
            choice_sink = sink if index == 0 else sink.fresh(handles.tokenizer.detokenizer())
            actors.append(RequestActor(handles.ports, request, choice_sink))
            await actors[-1].admit()
    except RequestRejected as rejected:
        for actor in actors:
            actor.close()
        raise from_rejection(rejected.rejection) from None
    except BaseException:
        for actor in actors:
            actor.close()
        raise
    return StartedGeneration(choices=tuple(actors), generation=generation, prompt=tuple(prompt))


_FAMILIES = itertools.count(1)  # sibling keys: unique among this process's requests


def max_choices(handles: ServerHandles) -> int:
    """The largest `n` this server runs: every choice is a row of one batch."""
    return min(MAX_CHOICES, handles.resolved.batch) if handles.mode == "batch" else 1
