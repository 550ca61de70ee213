"""Qwen3-Coder: `<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>`."""

from __future__ import annotations

import json
import re
from typing import Any

from api.pipeline.events import ToolCall
from api.pipeline.tools.hermes import TOOL_CALL_END, TOOL_CALL_START
from api.pipeline.tools.tagged import TaggedCallRouter

_FUNCTION = re.compile(r"<function=([^\s<>]+?)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^\s<>]+?)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder_body(body: str) -> list[ToolCall]:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        arguments = {key: coerce_parameter(value) for key, value in _PARAMETER.findall(inner)}
        calls.append(ToolCall.create(name, arguments))
    if not calls:
        raise ValueError("no <function=…> block")
    return calls


def coerce_parameter(raw: str) -> Any:
    """Values are untyped text; we take the JSON reading when there is one, else the string.

    mlx-lm coerces from the tool's JSON schema; the pipeline does not see schemas, and a JSON
    reading gets numbers, booleans, null, objects and arrays right for well-behaved models.
    The template wraps each value in newlines, which are not part of it.
    """
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    try:
        return json.loads(value, parse_constant=_reject_non_json_constant)
    except ValueError:
        return value


def _reject_non_json_constant(name: str) -> Any:
    # NaN/Infinity would re-encode as invalid JSON in the arguments string.
    raise ValueError(name)


def qwen3_coder_router() -> TaggedCallRouter:
    return TaggedCallRouter(TOOL_CALL_START, TOOL_CALL_END, parse_qwen3_coder_body)
