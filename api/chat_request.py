"""The typed requests every protocol translates into, and the chat core (api/chat.py) runs.

Everything here is already validated and holds only what the request itself said: the server's
defaults (sampling, max_tokens) are applied by the chat core, so `None` means "not set".
Messages and tools are in the shape chat templates read (OpenAI-style dicts: `developer` already
`system`, text parts flattened, tool-call arguments parsed to objects where they are JSON).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from api.images import ImagePart
from api.structured import ConstraintRequest
from model.engine.params import SamplingParams
from model.options import TemplateOptions


@attrs.frozen
class SamplingOverrides:
    """The sampling fields the request set (None: the server's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_context_size: int | None = None
    presence_context_size: int | None = None
    frequency_context_size: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None

    def apply(self, defaults: SamplingParams) -> SamplingParams:
        """`defaults` with every field the request set replaced."""
        values = attrs.asdict(self, recurse=False)
        return attrs.evolve(defaults, **{k: v for k, v in values.items() if v is not None})


@attrs.frozen
class GenerationFields:
    """Length, seed, stream, logprobs and choice-count fields as the request gave them."""

    sampling: SamplingOverrides = SamplingOverrides()
    max_tokens: int | None = None  # None: the route's default
    seed: int | None = None  # already reduced to 32 bits
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1  # choices to generate from one prefill (OpenAI's `n`)
    include_usage: bool = False  # a stream ends with a usage chunk (OpenAI's `stream_options`)
    # Reasoning tokens a row may generate before the server ends its reasoning (None: the server's).
    thinking_budget: int | None = None


@attrs.frozen
class ReasoningOptions:
    """Thinking switches and the other variables passed to the chat template."""

    enable_thinking: bool | None = None  # None: the template's default
    preserve_thinking: bool | None = None
    effort: str | None = None  # template depth ("low" | "medium" | "xhigh"), for templates that read one
    # Every other chat_template_kwargs variable, as (name, value) pairs: passed through as given.
    extra: tuple[tuple[str, Any], ...] = ()

    def with_defaults(self, args: Mapping[str, Any], thinking: str) -> ReasoningOptions:
        """These options over the server's (`--chat-template-args`, `--thinking on|off|auto`):
        the request's own variables win, then the flag, then the args."""
        switch = {"on": True, "off": False}.get(thinking)
        default = args.get("enable_thinking")
        enable = self.enable_thinking
        if enable is None:
            enable = switch if switch is not None else default if isinstance(default, bool) else None
        preserve = self.preserve_thinking
        if preserve is None and isinstance(args.get("preserve_thinking"), bool):
            preserve = args["preserve_thinking"]
        own = dict(self.extra)
        extra = {k: v for k, v in args.items() if k not in ("enable_thinking", "preserve_thinking") and k not in own}
        return attrs.evolve(
            self,
            enable_thinking=enable,
            preserve_thinking=preserve,
            extra=tuple(sorted({**extra, **own}.items())),
        )

    def template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self.extra)
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        if self.preserve_thinking is not None:
            kwargs["preserve_thinking"] = self.preserve_thinking
        if self.effort is not None:
            kwargs["reasoning_effort"] = self.effort
        return kwargs


@attrs.frozen
class ChatPrompt:
    """What the chat template renders."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None  # None: no tools (absent, empty or disabled)
    reasoning: ReasoningOptions = ReasoningOptions()
    images: tuple[ImagePart, ...] = ()  # in prompt order, each at a placeholder in the text (api/images.py)
    param: str = "messages"  # the request field the conversation came in (Responses: "input"), named in a 400

    def with_defaults(self, templates: TemplateOptions) -> ChatPrompt:
        """This prompt with the server's template defaults under its own variables (`--thinking`,
        `--chat-template-args`). The prompt cache keys token ids, so the same rendered prompt hits
        whichever way its variables came."""
        reasoning = self.reasoning.with_defaults(dict(templates.chat_template_args), templates.thinking)
        return attrs.evolve(self, reasoning=reasoning)


@attrs.frozen
class CachePoint:
    """A client's prompt-cache breakpoint (Anthropic `cache_control`): keep the prompt prefix that
    ends where `messages` (the conversation cut after the marked block; the leading system
    messages for a tool definition) rendered without a generation prompt ends, for `ttl_s`."""

    ttl_s: float
    messages: tuple[dict[str, Any], ...]


@attrs.frozen
class ChatRequest:
    """A chat turn: the prompt to template, how to generate, where to stop, what to constrain."""

    prompt: ChatPrompt
    generation: GenerationFields = GenerationFields()
    stop: tuple[str, ...] = ()
    constraint: ConstraintRequest | None = None
    cache_points: tuple[CachePoint, ...] = ()  # retention hints, mapped to prompt positions by the chat core
    cache_key: str | None = None  # OpenAI's prompt_cache_key (api/cache_hints.py): a namespace under isolation
    parallel_tool_calls: bool = True  # False: at most one tool call, generation ends after it
    # Fields, block types and values the request carried that this server does not know and
    # ignored (named as `thinking.type`, `output_config.foo`, ...): logged and counted, never a 400.
    ignored: tuple[str, ...] = ()


@attrs.frozen
class TextRequest:
    """A raw-prompt completion: no template, tools or reasoning split."""

    prompt: str | tuple[int, ...]  # text to encode, or token ids already checked against the vocabulary
    generation: GenerationFields = GenerationFields()
    stop: tuple[str, ...] = ()
    constraint: ConstraintRequest | None = None
