"""The Messages fields that steer generation rather than make up the prompt: `thinking` (its
switch, and its `budget_tokens`, enforced), `output_config` (effort, format; the older
`output_format`), the thinking edits of `context_management`, and `metadata`. What a request
says that this server does not know is appended to `ignored` (api/anthropic/translate.py reports
it), never refused; a value of the wrong kind is a 400.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from api import structured
from api.errors import bad_request
from api.fields import template_effort

log = logging.getLogger(__name__)

# thinking.type → enable_thinking ("adaptive": the model decides how much; the template's own budget)
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}
# output_config.effort → the reasoning_effort level it stands for (api/fields.py maps it to the template's)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}
CLEAR_THINKING = "clear_thinking_"  # the context edit's type prefix (clear_thinking_20251015, ...)
DEFAULT_THINKING_TURNS = 1  # a clear_thinking edit without `keep` keeps the last thinking turn
MAX_USER_ID_CHARS = 256  # metadata.user_id, Anthropic's bound
MIN_THINKING_BUDGET = 1024  # thinking.budget_tokens, Anthropic's least


def _ignore(ignored: list[str], name: str) -> None:
    log.debug("anthropic request: ignored %s", name)
    ignored.append(name)


def check_metadata(metadata: Any) -> None:
    """`metadata` holds `user_id` (a string of at most 256 characters, or null); it is not used,
    but a malformed one is the client's mistake. Other keys are ignored."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise bad_request("metadata: must be an object", param="metadata")
    user_id = metadata.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > MAX_USER_ID_CHARS):
        raise bad_request(
            f"metadata.user_id: must be a string of at most {MAX_USER_ID_CHARS} characters", param="metadata"
        )


def output_format(body: Mapping[str, Any]) -> structured.ConstraintFields:
    """`output_config.format` (or the older top-level `output_format`): a JSON schema the answer
    must follow, run as OpenAI's `response_format` json_schema. An unknown format type is a 400:
    ignoring it would answer in a shape the client did not ask for."""
    config = body.get("output_config")
    spec = config.get("format") if isinstance(config, Mapping) else None
    param, where = "output_config", "output_config.format"
    if spec is None:
        spec, param, where = body.get("output_format"), "output_format", "output_format"
    if spec is None:
        return structured.ConstraintFields()
    if not isinstance(spec, Mapping) or spec.get("type") != "json_schema":
        raise bad_request(f"{where}.type: must be 'json_schema'", param=param)
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise bad_request(f"{where}.schema: must be a JSON schema object", param=param)
    json_schema = {"name": "output", "schema": dict(schema), "strict": True}  # Anthropic's outputs are strict
    return structured.ConstraintFields(response_format={"type": "json_schema", "json_schema": json_schema})


def thinking_turns_kept(management: Any, ignored: list[str]) -> int | None:
    """How many of the latest thinking turns keep their thinking (None: all), from
    `context_management.edits`; edit types other than clear_thinking_* are ignored."""
    if management is None:
        return None
    if not isinstance(management, Mapping):
        raise bad_request("context_management: must be an object", param="context_management")
    edits = management.get("edits")
    if edits is None:
        return None
    if not isinstance(edits, list):
        raise bad_request("context_management.edits: must be an array", param="context_management")
    kept: int | None = None
    for index, edit in enumerate(edits):
        where = f"context_management.edits.{index}"
        kind = edit.get("type") if isinstance(edit, Mapping) else None
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type: must be a string", param="context_management")
        if not kind.startswith(CLEAR_THINKING):
            _ignore(ignored, "context_management.edits.type")
            continue
        keep = edit.get("keep", {"type": "thinking_turns", "value": DEFAULT_THINKING_TURNS})
        if keep == "all":
            kept = None
            continue
        value = keep.get("value") if isinstance(keep, Mapping) and keep.get("type") == "thinking_turns" else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad_request(
                f'{where}.keep: must be \'all\' or {{"type": "thinking_turns", "value": N}} with N >= 0',
                param="context_management",
            )
        kept = value
    return kept


def kept_thinking_turns(raw_messages: list[Any], kept: int | None) -> set[int]:
    """The indexes of the messages whose thinking blocks reach the template."""
    turns = [
        index
        for index, message in enumerate(raw_messages)
        if isinstance(message, Mapping)
        and message.get("role") == "assistant"
        and isinstance(message.get("content"), list)
        and any(isinstance(b, Mapping) and b.get("type") == "thinking" for b in message["content"])
    ]
    return set(turns if kept is None else turns[len(turns) - kept :] if kept else ())


def thinking_kwargs(body: Mapping[str, Any], ignored: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, Mapping):
        kwargs.update(extra)
    thinking = body.get("thinking")
    if thinking is None:
        return kwargs
    if not isinstance(thinking, Mapping):
        raise bad_request("thinking: must be an object with a type", param="thinking")
    kind = thinking.get("type")
    if not isinstance(kind, str):
        raise bad_request("thinking.type: must be 'enabled', 'adaptive' or 'disabled'", param="thinking")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise bad_request("thinking.budget_tokens: must be an integer", param="thinking")
    if kind not in THINKING_TYPES:
        _ignore(ignored, "thinking.type")  # a newer mode: the template's default
        return kwargs
    kwargs.setdefault("enable_thinking", THINKING_TYPES[kind])  # an explicit template kwarg wins
    return kwargs


def thinking_budget(body: Mapping[str, Any], max_tokens: int | None) -> int | None:
    """`thinking.budget_tokens` of an enabled `thinking`, with Anthropic's rules: at least
    `MIN_THINKING_BUDGET` and less than `max_tokens` (else a 400); the reasoning tokens a row may
    generate before the server ends its reasoning. None when thinking is not enabled or names no
    budget (`thinking_kwargs` checked its shape)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, Mapping) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if budget is None:
        return None
    if budget < MIN_THINKING_BUDGET:
        raise bad_request(
            f"thinking.enabled.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
            param="thinking",
        )
    if max_tokens is not None and max_tokens <= budget:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens")
    return int(budget)


def effort(config: Any, ignored: list[str]) -> str | None:
    """`output_config.effort` as the template's reasoning depth (None: not set or not known)."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise bad_request("output_config: must be an object", param="output_config")
    for key in config:
        if key not in ("effort", "format"):
            _ignore(ignored, f"output_config.{key}")
    level = config.get("effort")
    if level is None:
        return None
    if not isinstance(level, str):
        raise bad_request("output_config.effort: must be 'low', 'medium', 'high' or 'max'", param="output_config")
    if level not in EFFORTS:
        _ignore(ignored, "output_config.effort")
        return None
    return template_effort(EFFORTS[level])
