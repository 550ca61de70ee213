"""Tool-call grammars: the calls a model writes, in its own markup, as llguidance Lark
(a `tool_call` Constraint: model/engine/params.py; docs/structured-outputs.md).

A spec names the markup (`format`), the tools (`name`, `parameters`, `strict`) and how many calls:
`one` (a forced call: tool_choice naming a function, or "required" without parallel calls),
`many` (tool_choice "required" with parallel calls: one or more, as the template separates
them) or `lazy` (tool_choice "auto" with a strict tool: any text, and wherever the model opens a
call with the format's marker, the call must parse, its arguments following a strict tool's
schema; a call of a tool that is not strict takes any object).

Formats: hermes `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`, llama-3 JSON
`{"name", "parameters"}` (no marker: never lazy; several calls are a list), mistral
`[TOOL_CALLS][{...}]`, and Qwen3-Coder's XML `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
\\n</parameter>\\n</function>\\n</tool_call>`, whose values are text for string parameters (text
that cannot read as JSON, as api/pipeline/tools/qwen3_coder.py reads them) and compact JSON for
every other type. A marker that is one special token of the model's vocabulary is named by id
(`<[id]>`): a special token never matches its text. Free text around lazy calls is then any
token but the markers; a marker that is plain text is kept out of free text by a regex.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

# JSON is generated compact, with OpenAI's separators (model/text/grammar.py says why).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MODES = ("one", "many", "lazy")
PARAMETER_END = json.dumps("\n</parameter>\n")  # what closes an XML parameter (its value's newline first)


@attrs.frozen
class ToolFormat:
    opening: str  # the marker a call starts with (with the newline the template puts after it)
    closing: str
    args_key: str = "arguments"  # the JSON formats' key of the arguments object
    as_list: bool = False  # calls are a JSON array (mistral)
    xml: bool = False  # Qwen3-Coder's <function=…><parameter=…> body


TOOL_FORMATS = {
    "hermes": ToolFormat("<tool_call>\n", "\n</tool_call>"),
    "llama3_json": ToolFormat("", "", args_key="parameters"),
    "mistral": ToolFormat("[TOOL_CALLS]", "", as_list=True),
    "qwen3_coder": ToolFormat("<tool_call>\n", "\n</tool_call>", xml=True),
}


class ToolGrammarError(ValueError):
    """The spec asks for calls its format cannot express (a lazy llama-3 call has no marker)."""


def tool_markers(spec: dict[str, Any]) -> tuple[str, ...]:
    """The format's markers, stripped: those that may be one special token each."""
    fmt = TOOL_FORMATS.get(spec.get("format", "hermes"), TOOL_FORMATS["hermes"])
    return tuple(m.strip() for m in (fmt.opening, fmt.closing) if m.strip())


def tool_call_lark(spec: dict[str, Any], specials: frozenset[tuple[str, int]], *, strict: bool) -> str:
    """The Lark grammar of the calls `spec` asks for. `specials`: (marker, id) for markers that
    are one special token. Raises ToolGrammarError (or ValueError on a malformed spec)."""
    name = spec.get("format", "hermes")
    if name not in TOOL_FORMATS:
        raise ToolGrammarError(f"tool calls in the {name!r} format cannot be constrained")
    fmt, mode = TOOL_FORMATS[name], spec.get("mode", "one")
    if mode not in MODES:
        raise ToolGrammarError(f"unknown tool call mode {mode!r}")
    tools = spec.get("tools") or []
    if not tools:
        raise ToolGrammarError("no tool to call")
    if mode == "lazy" and not fmt.opening:
        raise ToolGrammarError(f"tool calls in the {name!r} format have no marker to constrain them by")
    builder = _Builder(dict(specials), strict=strict, lazy=mode == "lazy")
    call = builder.xml_calls(tools) if fmt.xml else builder.json_calls(tools, fmt, many=mode == "many")
    block = " ".join(p for p in (builder.literal(fmt.opening), call, builder.literal(fmt.closing)) if p)
    rules = builder.rules
    if mode == "lazy":
        rest = fmt.opening[len(fmt.opening.rstrip()) :]  # the opening's tail after its marker ("\n")
        after = " ".join(p for p in (json.dumps(rest) if rest else "", call, builder.literal(fmt.closing)) if p)
        start = builder.lazy_calls(fmt.opening, f"({after})")
        return "\n".join([start, *rules]) + "\n"
    if mode == "many" and not fmt.as_list and fmt.opening:  # (a list format repeats inside its array)
        rules.append(f"block: {block}")
        return "\n".join(['start: block ("\\n" block)*', *rules]) + "\n"
    return "\n".join([f"start: {block}", *rules]) + "\n"


class _Builder:
    def __init__(self, specials: dict[str, int], *, strict: bool, lazy: bool) -> None:
        self.specials = specials
        self.strict = strict
        self.lazy = lazy
        self.rules: list[str] = []

    def literal(self, text: str) -> str:
        """`text` as grammar: its marker by id when that is one special token ("\\n" <[id]>)."""
        core = text.strip()
        if core and core in self.specials:
            head, tail = text.split(core, 1)
            parts = [json.dumps(head)] if head else []
            parts.append(f"<[{self.specials[core]}]>")
            parts += [json.dumps(tail)] if tail else []
            return " ".join(parts)
        return json.dumps(text) if text else ""

    def lazy_calls(self, opening: str, block_rest: str) -> str:
        """`start` of lazy calls: any text, and wherever the marker opens a call, `block_rest`
        (the block after its marker) must follow; a marker that is one special token is kept
        out of the text by id, one that is text by a regex (the text before each call is one
        lazy lexeme ending at the marker: a greedy one would run past it)."""
        core = opening.strip()
        if core in self.specials:
            self.rules.append(f"free: <[^{self.specials[core]}]>*")
            return f"start: free ({self.literal(core)} {block_rest} free)*"
        marker = _regex_escape(core)
        self.rules.append(f"head[lazy]: /(?s:.*){marker}/")
        self.rules.append(f"TAIL: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/")
        return f"start: (head {block_rest})* TAIL"

    def _parameters(self, tool: dict[str, Any]) -> Any:
        if self.lazy and not tool.get("strict"):
            return {"type": "object"}  # a lazy call of a tool that is not strict: any arguments
        return tool.get("parameters") or {"type": "object"}

    def json_calls(self, tools: list[dict[str, Any]], fmt: ToolFormat, *, many: bool) -> str:
        hoisted: dict[str, Any] = {}
        calls = []
        for index, tool in enumerate(tools):
            parameters = _hoisted(self._parameters(tool), f"tool{index}", hoisted)
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool["name"]}, fmt.args_key: parameters},
                    "required": ["name", fmt.args_key],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if fmt.as_list or (many and not fmt.opening):
            schema = {"type": "array", "items": schema, "minItems": 1, **({} if many else {"maxItems": 1})}
        schema = {**schema, "x-guidance": {**JSON_DEFAULTS, "lenient": not self.strict}}
        if hoisted:
            schema["$defs"] = hoisted
        return f"%json {json.dumps(schema)}"

    def xml_calls(self, tools: list[dict[str, Any]]) -> str:
        names = []
        for index, tool in enumerate(tools):
            rule = f"fn{index}"
            params = self._xml_parameters(self._parameters(tool), rule)
            opening = json.dumps(f"<function={tool['name']}>\n")
            self.rules.append(f'{rule}: {opening} {params} "</function>"')
            names.append(rule)
        return "(" + " | ".join(names) + ")"

    def _xml_parameters(self, schema: Any, rule: str) -> str:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or not properties:
            return f'("<parameter=" /[^<>\\s]+/ ">\\n" {self._text_value()})*'
        required = set(schema.get("required") or ())
        defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
        parts = []
        for i, (key, prop) in enumerate(properties.items()):
            value = self._xml_value(prop if isinstance(prop, dict) else {}, defs)
            opening = json.dumps(f"<parameter={key}>\n")
            self.rules.append(f"{rule}_{i}: {opening} {value}")
            parts.append(f"{rule}_{i}" + ("" if key in required else "?"))
        return " ".join(parts)

    def _xml_value(self, prop: dict[str, Any], defs: dict[str, Any]) -> str:
        """A parameter's value and its closing tag: a string parameter's value is its text, any
        other's its compact JSON."""
        enum = prop.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(json.dumps(v) for v in enum) + f") {PARAMETER_END}"
        if prop.get("type") == "string" and "$ref" not in prop:
            low, high = prop.get("minLength"), prop.get("maxLength")
            return self._text_value(low if isinstance(low, int) else 0, high if isinstance(high, int) else None)
        value = {**prop, **defs, "x-guidance": {**JSON_DEFAULTS, "lenient": not self.strict}}
        return f"%json {json.dumps(value)} {PARAMETER_END}"

    def _text_value(self, low: int = 0, high: int | None = None) -> str:
        """A text value (`low` to `high` characters) and its closing tag: a lazy lexeme (it ends
        at the first closing tag) whose text does not read as JSON other than a string (the
        parser takes a value's JSON reading when it has one)."""
        bounded = low > 0 or high is not None
        name = f"text_{low}_{high}" if bounded else "text"
        length = f"(?s:.{{{low},{'' if high is None else high}}})" if bounded else "(?s:.*)"
        rules = [
            f"{name.upper()}_BODY: /{length}/ & ~/\\s*(-?[0-9](?s:.*)|true|false|null|[\\[{{](?s:.*))\\s*/",
            f"{name}_value[suffix={PARAMETER_END}]: {name.upper()}_BODY",
        ]
        self.rules += [rule for rule in rules if rule not in self.rules]
        return f"{name}_value"


def _regex_escape(text: str) -> str:
    """`text` matched literally in a /regex/ (Rust's syntax: `\\<` would be a word boundary)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else "\\/" if c == "/" else c for c in text)


# Keywords whose value is a map of names to subschemas (a name may be any string, "const"
# included), and keywords whose value is data, not a schema (a "$ref" key there is no reference).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _hoisted(parameters: Any, name: str, hoisted: dict[str, Any]) -> Any:
    """A tool's parameters schema as embedded in the call wrapper.

    Its local refs ("#", "#/$defs/X", "#/definitions/X", any "#/pointer") name its own root, but
    embedded they would resolve against the wrapper's: a schema with such refs moves, whole
    (its own $defs included), to the wrapper's `$defs[name]`, every local ref prefixed with that
    path, and the wrapper refers to it there. Without local refs it stays inline, as given.
    """
    if not isinstance(parameters, dict):
        return parameters
    prefix = f"#/$defs/{name}"
    rebased = _rebased(parameters, prefix)
    if rebased == parameters:
        return parameters
    rebased.pop("$id", None)  # a base URI of its own would re-anchor the rebased refs
    hoisted[name] = rebased
    return {"$ref": prefix}


def _rebased(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_rebased(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _rebased(v, prefix) for k, v in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, prefix)
    return out
