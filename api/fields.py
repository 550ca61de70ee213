"""Validators for the generation fields the protocols share, each field checked once.

The Anthropic and Responses translators hand over the fields they accept under the same names
as OpenAI's, so every protocol answers the same 400 (mlx_lm.server's wording where it has one)
for the same bad value; a field a protocol spells differently is named its way (Responses'
`reasoning.effort`: `reasoning_options`'s `effort_param`). Nothing here reads the server's defaults: see api/chat.py.

Every number is bounded as the OpenAI / Anthropic references document it (temperature 0..2, or
0..1 for Anthropic; top_p and min_p 0..1; presence / frequency penalties -2..2; logit biases
-100..100); what they leave open is bounded where a larger value could only be a mistake
(counts and windows fit 32 bits, the repetition penalty is at most `MAX_REPETITION_PENALTY`).
Non-finite numbers never get here (api/http/strict_json.py) and are rejected again if they do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from api.chat_request import GenerationFields, ReasoningOptions, SamplingOverrides
from api.errors import bad_request

MAX_TOP_LOGPROBS = 11  # mlx_lm.server's cap (within OpenAI's 20)
MAX_CHOICES = 128  # OpenAI's bound on `n`; the chat core bounds it by the server's batch too
MAX_INT = 2**31 - 1  # token counts, top_k and penalty windows: MLX indexes with 32-bit ints
MAX_TEMPERATURE = 2.0  # OpenAI's range; Anthropic's is 0..1 (`max_temperature`)
MAX_REPETITION_PENALTY = 100.0  # logits are divided / multiplied by it: past this, only -inf remains
MAX_PENALTY = 2.0  # presence / frequency, OpenAI's -2..2
MAX_LOGIT_BIAS = 100.0  # OpenAI's -100..100

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_EFFORT_MESSAGE = "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'"
# Templates with a depth variable get one of three levels; "none" (thinking off) passes none.
_TEMPLATE_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh"}
TEMPLATE_SWITCHES = ("enable_thinking", "preserve_thinking")  # booleans; other chat_template_kwargs pass as given
# Names the renderer passes itself: a chat_template_kwargs variable cannot replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt")


def pick(body: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The fields of `body` among `names` (present keys only, null values included)."""
    return {name: body[name] for name in names if name in body}


def parse_generation(
    fields: Mapping[str, Any],
    *,
    vocab_size: int | None,
    stream: bool | None = None,
    max_temperature: float = MAX_TEMPERATURE,
) -> GenerationFields:
    """Every sampling / length / seed / stream / logprobs field, in this order.

    `vocab_size`, when known, bounds `logit_bias` token ids. `stream`, when the protocol has
    already read its own stream flag, replaces the `stream` field.
    """
    sampling = parse_sampling(fields, vocab_size=vocab_size, max_temperature=max_temperature)
    max_tokens = token_count(fields.get("max_tokens"), "max_tokens")
    completion_max = token_count(fields.get("max_completion_tokens"), "max_completion_tokens")
    seed = fields.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", param="seed")
    if stream is None:
        stream = stream_flag(fields.get("stream", False), "stream must be a boolean")
    logprobs, top_logprobs = logprobs_fields(fields)
    n = integer(fields.get("n"), "n", minimum=1, maximum=MAX_CHOICES, what=f"an integer from 1 to {MAX_CHOICES}")
    budget = integer(fields.get("thinking_token_budget"), "thinking_token_budget", minimum=0, what=_BOUNDED_COUNT)
    return GenerationFields(
        sampling=sampling,
        max_tokens=completion_max or max_tokens,  # max_completion_tokens wins over max_tokens
        seed=None if seed is None else seed & 0xFFFFFFFF,
        stream=stream,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n or 1,
        thinking_budget=budget,
    )


def parse_sampling(
    fields: Mapping[str, Any], *, vocab_size: int | None, max_temperature: float = MAX_TEMPERATURE
) -> SamplingOverrides:
    def unit(name: str, what: str = "a float between 0 and 1") -> float | None:
        return number(fields.get(name), name, minimum=0.0, maximum=1.0, what=what)

    def penalty(name: str) -> float | None:
        what = f"a float between {-MAX_PENALTY:g} and {MAX_PENALTY:g}"
        return number(fields.get(name), name, minimum=-MAX_PENALTY, maximum=MAX_PENALTY, what=what)

    values: dict[str, Any] = {
        "temperature": number(
            fields.get("temperature"),
            "temperature",
            minimum=0.0,
            maximum=max_temperature,
            what=f"a non-negative float (at most {max_temperature:g})",
        ),
        "top_p": unit("top_p"),
        "top_k": top_k(fields.get("top_k")),
        "min_p": unit("min_p"),
        "xtc_probability": unit("xtc_probability", "a float between 0.0 and 1.0"),
        "xtc_threshold": unit("xtc_threshold", "a float between 0.0 and 1.0"),
        # mlx_lm.server's wording, with the bound; 0 is "off" (the sampler skips 0 and 1)
        "repetition_penalty": number(
            fields.get("repetition_penalty"),
            "repetition_penalty",
            minimum=0.0,
            maximum=MAX_REPETITION_PENALTY,
            what=f"a non-negative float (at most {MAX_REPETITION_PENALTY:g})",
        ),
        "presence_penalty": penalty("presence_penalty"),
        "frequency_penalty": penalty("frequency_penalty"),
    }
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        values[name] = integer(fields.get(name), name, minimum=0, maximum=MAX_INT, what=_BOUNDED_COUNT)
    values["logit_bias"] = logit_bias(fields.get("logit_bias"), vocab_size)
    return SamplingOverrides(**values)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    # An int compares exactly (math.isfinite(10**400) would raise OverflowError).
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def number(
    value: Any, name: str, *, what: str, minimum: float | None = None, maximum: float | None = None
) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise bad_request(f"{name} must be {what}", param=name)
    return float(value)


_BOUNDED_COUNT = f"a non-negative integer (at most {MAX_INT})"


def integer(value: Any, name: str, *, minimum: int, what: str, maximum: int = MAX_INT) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # JSON writers that emit 64.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise bad_request(f"{name} must be {what}", param=name)
    return value


def token_count(value: Any, name: str) -> int | None:
    """A length in tokens (max_tokens and its aliases): 1 .. MAX_INT."""
    return integer(value, name, minimum=1, what=f"a positive integer (at most {MAX_INT})")


def top_k(value: Any) -> int | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == -1:
        return 0  # vLLM / llama.cpp clients spell "off" as -1
    return integer(value, "top_k", minimum=0, what=_BOUNDED_COUNT)


def logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...] | None:
    """`{"token id": bias}`: JSON keys are strings, coerced to int as mlx_lm does."""
    if value is None:
        return None
    message = "logit_bias must be a dict of int to float"
    if not isinstance(value, dict):
        raise bad_request(message, param="logit_bias")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        try:
            token = int(key)
            amount = float(raw)
        except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
            raise bad_request(message, param="logit_bias") from None
        if isinstance(raw, bool) or not math.isfinite(amount):
            raise bad_request(message, param="logit_bias")
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise bad_request(
                f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}", param="logit_bias"
            )
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad_request(
                f"logit_bias token id {token} is out of range (vocabulary size {vocab_size})", param="logit_bias"
            )
        bias[token] = amount
    return tuple(sorted(bias.items()))


def logprobs_fields(fields: Mapping[str, Any]) -> tuple[bool, int]:
    """mlx_lm.server's checks and messages; `top_logprobs: -1` (its default) means unset."""
    logprobs = fields.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be of type bool", param="logprobs")
    top = fields.get("top_logprobs")
    if top is None or (top == -1 and not isinstance(top, bool)):
        top = 0
    elif isinstance(top, bool) or not isinstance(top, int):
        raise bad_request("top_logprobs must be of type int", param="top_logprobs")
    elif top < 0:
        raise bad_request("top_logprobs must be at least 0", param="top_logprobs")
    elif top > MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return bool(logprobs), top


def stream_flag(value: Any, message: str) -> bool:
    """A boolean `stream` (null: false); anything else is a 400 with the protocol's `message`."""
    if value is not None and not isinstance(value, bool):
        raise bad_request(message, param="stream")
    return bool(value)


def flag(value: Any, name: str) -> bool | None:
    """A boolean field (`parallel_tool_calls`, `store`); None when absent or null."""
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", param=name)
    return value


def stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    return tuple(s for s in value if s)  # empty strings dropped


def template_effort(effort: str) -> str | None:
    """A `reasoning_effort` level as the depth templates read (None for "none" or an unknown one)."""
    return _TEMPLATE_EFFORT.get(effort)


def reasoning_options(template_kwargs: Any, effort: Any, *, effort_param: str = "reasoning_effort") -> ReasoningOptions:
    """`chat_template_kwargs` and `reasoning_effort`: explicit enable_thinking > the effort
    ("none" = off, any level = on) > the template's default. Every other variable reaches the
    template as given. `effort_param`: the effort's name in the request's protocol (Responses:
    `reasoning.effort`), as its 400 names it."""
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    switches: dict[str, bool] = {}
    extra: dict[str, Any] = {}
    for name, value in (template_kwargs or {}).items():
        if name in RESERVED_TEMPLATE_NAMES:
            raise bad_request(
                f"chat_template_kwargs.{name} is set by the server and cannot be given", param="chat_template_kwargs"
            )
        if name not in TEMPLATE_SWITCHES:
            extra[name] = value
        elif value is not None and not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{name} must be a boolean", param="chat_template_kwargs")
        elif value is not None:
            switches[name] = value
    if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
        message = REASONING_EFFORT_MESSAGE.replace("reasoning_effort", effort_param, 1)
        raise bad_request(message, param=effort_param)
    thinking = switches.get("enable_thinking")
    if thinking is None and effort is not None:
        thinking = effort != "none"
    return ReasoningOptions(
        enable_thinking=thinking,
        preserve_thinking=switches.get("preserve_thinking"),
        effort=_TEMPLATE_EFFORT.get(effort) if isinstance(effort, str) else None,
        extra=tuple(sorted(extra.items())),
    )
