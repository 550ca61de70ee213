"""Structured-output request fields → a `Constraint` (model/engine/params.py) for the row's sampler.

Fields, in precedence order (the first present wins): a forced function call (`tool_choice`
naming a function, or "required") > `guided_grammar` > `response_format` json_schema (or vLLM's
`guided_json`) > json_object > `structured_outputs` > `guided_regex` > `guided_choice`.
`response_format: {"type": "text"}` is no constraint. A Responses-shaped `text.format` is read
when `response_format` is absent (`response_format_from_text_format` is the mapping). An
invalid schema / regex / grammar is a 400 carrying the engine's message.

A forced call's grammar wraps the call in the model's own tool-call markup, known only once the
chat template is: `request_constraint` checks the request with the default (hermes) markup, and
`ConstraintRequest.for_tool_format` rebuilds it for the model's. A model whose markup has no
grammar falls back on the other fields. Without a grammar engine installed, requests are served
unconstrained and the response gets a `Warning` header saying so.

Two checks, both 400s carrying the engine's message: the translators validate the grammar text
(`request_constraint`, no tokenizer), and the chat core compiles the constraint it will run
against the model's tokenizer and computes its first mask (`check_compiles`), so a grammar that
exceeds the engine's limits or can match nothing is refused when the request arrives instead
of ending the row at once. Both run on worker threads (api/http/offload.py). Nothing here touches
MLX; the rows' grammars are compiled and enforced on the GPU-worker thread (model/text/grammar.py).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
from quart import after_this_request, has_request_context
from quart.typing import ResponseTypes

from api.errors import bad_request
from model.engine.params import Constraint
from model.text import grammar
from model.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

WARNING_HEADER = "Warning"
DEFAULT_TOOL_FORMAT = "hermes"


@attrs.frozen
class ConstraintFields:
    """The structured-output fields other than a forced tool call, unparsed: they are read only
    when no forced call takes precedence."""

    guided_grammar: Any = None
    response_format: Any = None
    text_format: Any = None  # Responses-style `text.format`, read when response_format is absent
    guided_json: Any = None
    structured_outputs: Any = None
    guided_regex: Any = None
    guided_choice: Any = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ConstraintFields:
        text = body.get("text")
        return cls(
            guided_grammar=body.get("guided_grammar"),
            response_format=body.get("response_format"),
            text_format=text.get("format") if isinstance(text, Mapping) else None,
            guided_json=body.get("guided_json"),
            structured_outputs=body.get("structured_outputs"),
            guided_regex=body.get("guided_regex"),
            guided_choice=body.get("guided_choice"),
        )

    def select(self) -> tuple[Constraint | None, str | None]:
        """The constraint these fields ask for and the param it came from. Raises ApiError (400)."""
        if self.guided_grammar is not None:
            return Constraint("grammar", _string(self.guided_grammar, "guided_grammar")), "guided_grammar"
        response_format = self.response_format
        if response_format is None and self.text_format is not None:
            response_format = response_format_from_text_format(self.text_format)
        rf = _response_format(response_format)
        if rf is not None and rf.kind == "json_schema":
            return rf, "response_format"
        if self.guided_json is not None:
            return _schema_constraint(self.guided_json, strict=False, param="guided_json"), "guided_json"
        if rf is not None:
            return rf, "response_format"
        so = _structured_outputs(self.structured_outputs)
        if so is not None:
            return so, "structured_outputs"
        if self.guided_regex is not None:
            return Constraint("regex", _string(self.guided_regex, "guided_regex")), "guided_regex"
        if self.guided_choice is not None:
            return _choice(self.guided_choice, "guided_choice"), "guided_choice"
        return None, None


@attrs.frozen
class ForcedToolCall:
    """Calls of `tools` ((name, parameters schema or None) pairs; `strict_tools` names those
    marked strict) as a grammar (model/text/tool_grammar.py): `mode` "one" (exactly one call),
    "many" (one or more: tool_choice "required" with parallel calls), or "lazy" (tool_choice
    "auto" with a strict tool: free text, and a call the model opens must parse, a strict
    tool's arguments following its schema)."""

    tools: tuple[tuple[str, Any], ...]
    strict: bool = False
    mode: str = "one"
    strict_tools: frozenset[str] = frozenset()

    def constraint(self, tool_format: str) -> Constraint | None:
        """The calls in `tool_format`'s markup; None when that markup cannot express them."""
        if tool_format not in grammar.TOOL_FORMATS or (self.mode == "lazy" and tool_format == "llama3_json"):
            log.info("%s tool calls in the %s format are not constrained", self.mode, tool_format)
            return None
        tools = [{"name": n, "parameters": p, "strict": n in self.strict_tools} for n, p in self.tools]
        spec = {"format": tool_format, "mode": self.mode, "tools": tools}
        return Constraint("tool_call", json.dumps(spec), strict=self.strict)


@attrs.frozen
class ConstraintRequest:
    """A request's validated constraint, as built before the model's tool-call markup is known."""

    constraint: Constraint
    forced: ForcedToolCall | None = None
    fields: ConstraintFields = ConstraintFields()
    param: str | None = None  # the field it came from (named in a 400)

    def for_tool_format(self, tool_format: str | None) -> Constraint | None:
        """The constraint to run once the tool format is known (None: the request has no tools)."""
        if self.forced is None or tool_format is None:
            return self.constraint
        constraint = self.forced.constraint(tool_format)
        if constraint is None:
            return _validated(*self.fields.select())
        return _validated(constraint, "tool_choice")


def forced_tool_call(tools: Any, choice: Any, *, parallel: bool = True) -> ForcedToolCall | None:
    """tool_choice {"type": "function", "function": {"name"}} (or Responses' {"type":
    "function", "name"}) or "required" (several calls when `parallel`) over OpenAI-shaped (or
    flat) tools; under "auto" (or none given), the lazy grammar of the tools when one of them is
    `strict`. Raises ApiError (400)."""
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    functions: dict[str, Any] = {}
    strict_tools: set[str] = set()
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        fn: Mapping[str, Any] = function if isinstance(function, Mapping) else tool  # Responses: flat
        name = fn.get("name")
        if isinstance(name, str):
            functions[name] = fn.get("parameters")
            if fn.get("strict") is True:
                strict_tools.add(name)
    mode = "one"
    if choice in (None, "auto"):
        if not strict_tools:
            return None
        chosen, mode = list(functions), "lazy"
    elif choice == "required":
        chosen, mode = list(functions), "many" if parallel else "one"
    elif isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = (function if isinstance(function, Mapping) else choice).get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", param="tool_choice")
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        chosen = [name]
    else:
        return None
    if not chosen:
        return None
    for name in chosen:
        parameters = functions[name]
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_request(f"tools: the parameters of {name!r} must be a JSON schema object", param="tools")
    chosen_tools = tuple((name, functions[name]) for name in chosen)
    return ForcedToolCall(chosen_tools, strict=bool(strict_tools), mode=mode, strict_tools=frozenset(strict_tools))


def request_constraint(fields: ConstraintFields, forced: ForcedToolCall | None = None) -> ConstraintRequest | None:
    """The request's constraint, validated (400 if invalid); None for free generation, and
    also (with a Warning header) when no grammar engine is installed."""
    if forced is not None and forced.mode == "lazy" and fields.select()[0] is not None:
        forced = None  # another output constraint asked for: strict tools under "auto" yield to it
    if forced is not None:
        param: str | None = "tool_choice" if forced.mode != "lazy" else "tools"
        constraint = _validated(forced.constraint(DEFAULT_TOOL_FORMAT), param)
    else:
        constraint, param = fields.select()
        constraint = _validated(constraint, param)
    if constraint is None:
        return None
    if not grammar.available():
        add_warning(not_enforced_warning(constraint))
        return None
    return ConstraintRequest(constraint, forced=forced, fields=fields, param=param)


_compilers: weakref.WeakKeyDictionary[Any, grammar.GrammarCompiler | None] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiles_for(tokenizer: Any, constraint: Constraint | None) -> bool:
    """Whether `check_compiles` has work to do: a constraint, an engine, a real tokenizer."""
    return constraint is not None and grammar.available() and isinstance(tokenizer, Tokenizer)


def check_compiles(tokenizer: Any, constraint: Constraint | None, param: str | None) -> None:
    """Compile `constraint` for `tokenizer` and compute its first mask. Raises ApiError (400)
    when it cannot run. Blocking (a large grammar takes long to build): call it off the loop."""
    if constraint is None or not grammar.available():
        return
    compiler = _compiler(tokenizer)
    if compiler is None:
        return
    try:
        compiler.check(constraint)
    except grammar.GrammarError as exc:
        raise bad_request(f"invalid {_what(constraint)}: {exc}", param=param) from None


def _compiler(tokenizer: Any) -> grammar.GrammarCompiler | None:
    """One request-time compiler per tokenizer, built on first use (a large vocabulary takes a
    moment to index) and cached with its compiled grammars."""
    if not isinstance(tokenizer, Tokenizer):  # a test double: the worker enforces what it can
        return None
    with _compilers_lock:
        if tokenizer in _compilers:
            return _compilers[tokenizer]
    compiler = grammar.compiler_for_tokenizer(tokenizer)
    with _compilers_lock:
        return _compilers.setdefault(tokenizer, compiler)


def body_constraint(body: Mapping[str, Any]) -> ConstraintRequest | None:
    """`request_constraint` for an OpenAI chat or completions body."""
    parallel = body.get("parallel_tool_calls") is not False
    forced = forced_tool_call(body.get("tools"), body.get("tool_choice"), parallel=parallel)
    return request_constraint(ConstraintFields.from_body(body), forced)


def not_enforced_warning(constraint: Constraint) -> str:
    return f'299 - "{_what(constraint)} not enforced: no grammar engine installed"'


def add_warning(text: str) -> None:
    """Attach a Warning header to the response of the request being handled (if any)."""
    if not has_request_context():
        return

    @after_this_request
    async def _add(response: ResponseTypes) -> ResponseTypes:
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


def _validated(constraint: Constraint | None, param: str | None) -> Constraint | None:
    if constraint is not None and grammar.available():
        try:
            grammar.validate(constraint)
        except grammar.GrammarError as exc:
            raise bad_request(f"invalid {_what(constraint)}: {exc}", param=param) from None
    return constraint


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", param=name)
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
        return Constraint("grammar", _string(value.get("grammar"), "grammar"))
    if value.get("json") is not None:
        return _schema_constraint(value["json"], strict=False, param="structured_outputs")
    if value.get("json_object"):
        return Constraint("json_object")
    if value.get("regex") is not None:
        return Constraint("regex", _string(value.get("regex"), "regex"))
    if value.get("choice") is not None:
        return _choice(value["choice"], "structured_outputs")
    return None


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
