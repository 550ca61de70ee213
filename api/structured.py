"""Structured-output request fields → a `Constraint` (model/params.py) for the row's sampler.

One entry point per concern:

* `constraint_from_body(body, tool_format=...)` — pure: parse and validate. Fields, in precedence
  order (spec §1.10; the first present wins): a forced function call (`tool_choice` naming a
  function, or "required") > `guided_grammar` > `response_format` json_schema (or vLLM's
  `guided_json`) > json_object > `structured_outputs` > `guided_regex` > `guided_choice`.
  `response_format: {"type": "text"}` is no constraint. A Responses-shaped `text.format` is read
  when `response_format` is absent (`response_format_from_text_format` is the mapping).
  An invalid schema / regex / grammar raises `bad_request` (400) carrying the engine's message.
* `request_constraint(body, tool_format=...)` — what parse_generation calls: the above, except
  that when no grammar engine is installed (or MLX_BUN_GRAMMAR=0) the request is served
  unconstrained and the response gets a `Warning` header saying so.

Nothing here touches MLX; grammars are compiled and enforced on the GPU-worker thread
(model/grammar.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from api.errors import ApiError, bad_request
from model import grammar
from model.params import Constraint

log = logging.getLogger(__name__)

WARNING_HEADER = "Warning"


# --- the fields ----------------------------------------------------------------------------------


def constraint_from_body(body: Mapping[str, Any], *, tool_format: str | None = None) -> Constraint | None:
    """The request's constraint (None = free generation). Raises ApiError (400)."""
    constraint, param = _select(body, tool_format)
    if constraint is not None and grammar.available():
        try:
            grammar.validate(constraint)
        except grammar.GrammarError as exc:
            raise bad_request(f"invalid {_what(constraint)}: {exc}", param=param) from None
    return constraint


def request_constraint(body: Mapping[str, Any], *, tool_format: str | None = None) -> Constraint | None:
    """`constraint_from_body`, degraded to None (+ a Warning header) without a grammar engine."""
    constraint = constraint_from_body(body, tool_format=tool_format)
    if constraint is None or grammar.available():
        return constraint
    add_warning(not_enforced_warning(constraint))
    return None


def not_enforced_warning(constraint: Constraint) -> str:
    why = "grammar engine disabled" if grammar._ll is not None else "no grammar engine installed"
    return f'299 - "{_what(constraint)} not enforced: {why}"'


def add_warning(text: str) -> None:
    """Attach a Warning header to the response of the request being handled (if any)."""
    try:
        from quart import after_this_request, has_request_context
    except ImportError:  # pragma: no cover
        return
    if not has_request_context():
        return

    @after_this_request
    async def _add(response: Any) -> Any:
        response.headers[WARNING_HEADER] = text
        return response


def response_format_from_text_format(fmt: Any) -> dict[str, Any] | None:
    """Responses `text.format` → the chat `response_format` it means.

    {"type": "json_schema", "name", "schema", "strict", "description"} (flat, Responses style)
    → {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
    {"type": "json_object"} and {"type": "text"} map as they are.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad_request("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema" and "json_schema" not in fmt:
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return dict(fmt)


def _select(body: Mapping[str, Any], tool_format: str | None) -> tuple[Constraint | None, str | None]:
    tool = _forced_tool_call(body, tool_format)
    if tool is not None:
        return tool, "tool_choice"
    if body.get("guided_grammar") is not None:
        return Constraint("grammar", _string(body, "guided_grammar")), "guided_grammar"
    response_format = body.get("response_format")
    if response_format is None:
        text = body.get("text")
        if isinstance(text, Mapping) and text.get("format") is not None:
            response_format = response_format_from_text_format(text.get("format"))
    rf = _response_format(response_format)
    if rf is not None and rf.kind == "json_schema":
        return rf, "response_format"
    if body.get("guided_json") is not None:
        return _schema_constraint(body["guided_json"], strict=False, param="guided_json"), "guided_json"
    if rf is not None:
        return rf, "response_format"
    so = _structured_outputs(body.get("structured_outputs"))
    if so is not None:
        return so, "structured_outputs"
    if body.get("guided_regex") is not None:
        return Constraint("regex", _string(body, "guided_regex")), "guided_regex"
    if body.get("guided_choice") is not None:
        return _choice(body["guided_choice"], "guided_choice"), "guided_choice"
    return None, None


def _string(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{key} must be a non-empty string", param=key)
    return value


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise bad_request(f"{param} must be a non-empty array of strings", param=param)
    return Constraint("choice", json.dumps(value))


def _schema_constraint(schema: Any, *, strict: bool, param: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON ({exc})", param=param) from None
    if not isinstance(schema, Mapping):
        raise bad_request(f"{param}: the schema must be a JSON object", param=param)
    return Constraint("json_schema", json.dumps(schema, sort_keys=False), strict=strict)


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_request("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise bad_request("response_format.json_schema must be an object", param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean", param="response_format")
        schema = spec.get("schema", {"type": "object"})
        return _schema_constraint(schema, strict=bool(strict), param="response_format")
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _structured_outputs(value: Any) -> Constraint | None:
    """vLLM's `structured_outputs`: {json | json_object | regex | choice | grammar}."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    if value.get("grammar") is not None:
        return Constraint("grammar", _string(value, "grammar"))
    if value.get("json") is not None:
        return _schema_constraint(value["json"], strict=False, param="structured_outputs")
    if value.get("json_object"):
        return Constraint("json_object")
    if value.get("regex") is not None:
        return Constraint("regex", _string(value, "regex"))
    if value.get("choice") is not None:
        return _choice(value["choice"], "structured_outputs")
    return None


def _forced_tool_call(body: Mapping[str, Any], tool_format: str | None) -> Constraint | None:
    """tool_choice {"type": "function", "function": {"name"}} (or Responses' {"type":
    "function", "name"}) or "required" → exactly one call, arguments per the tool's schema."""
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or choice in (None, "none", "auto"):
        return None
    functions = {}
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool  # Responses: flat
        name = fn.get("name")
        if isinstance(name, str):
            functions[name] = fn.get("parameters")
    if choice == "required":
        chosen = list(functions)
    elif isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice
        name = fn.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", param="tool_choice")
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        chosen = [name]
    else:
        return None
    if not chosen:
        return None
    fmt = tool_format or "hermes"
    if fmt not in grammar.TOOL_FORMATS:
        log.info("forced tool call in the %s format is not constrained", fmt)
        return None
    for name in chosen:
        parameters = functions[name]
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_request(f"tools: the parameters of {name!r} must be a JSON schema object", param="tools")
    spec = {"format": fmt, "tools": [{"name": n, "parameters": functions[n]} for n in chosen]}
    strict = any(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and t["function"].get("strict") is True
        for t in tools
    )
    return Constraint("tool_call", json.dumps(spec), strict=strict)


def _what(constraint: Constraint) -> str:
    return {
        "json_object": "response_format json_object",
        "json_schema": "JSON schema",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
        "lark": "grammar",
        "tool_call": "tool parameters schema",
    }[constraint.kind]


__all__ = [
    "ApiError",
    "WARNING_HEADER",
    "add_warning",
    "constraint_from_body",
    "not_enforced_warning",
    "request_constraint",
    "response_format_from_text_format",
]
