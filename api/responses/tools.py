"""Responses tools as Codex sends them: `function`, `custom` (free-form input, optionally a
grammar) and `namespace` groups of either; built-in tools (web_search, tool_search, ...) are
dropped (the server runs none).

Chat templates know only function tools with a JSON-schema `parameters`, so:

* a custom tool is shown to the template as a function with one string parameter, `input`, its
  description saying the input is free-form text and, for a grammar format, the grammar; the
  model's call `{"name": "apply_patch", "arguments": {"input": "..."}}` comes back as a
  `custom_tool_call` item whose `input` is that string (`InputStream` decodes it as its JSON
  pieces stream, for `response.custom_tool_call_input.delta`);
* a namespace's tools are shown as `namespace.name`; a call of that name (or of the bare inner
  name, when no other tool has it) comes back with OpenAI's `namespace` field and the inner
  `name`, which is what Codex dispatches on (a `multi_agent_v1.close_agent` name alone is an
  "unsupported call" to Codex 0.169).

`tool_choice: {"type": "custom", "name"}` forces that tool. With a grammar format (`lark` or
`regex`) the whole generated text is constrained by the grammar and is the call's input (a JSON
string inside the model's call markup cannot be constrained by a grammar over the raw text); a
text-format tool is forced as a function call of its `input`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from api.errors import bad_request

GRAMMAR_SYNTAXES = ("lark", "regex")
INPUT = "input"  # the one parameter a custom tool's function view has
_OPENING = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@attrs.frozen
class ToolSpec:
    """One callable tool: its name in the prompt, its kind, its namespace and its own name."""

    called: str  # what the template shows and the model calls (`namespace.name` in a namespace)
    kind: str  # "function" | "custom"
    name: str  # the item's `name` (the inner name in a namespace)
    namespace: str | None = None
    description: str | None = None
    parameters: Any = None  # a function's JSON schema
    strict: Any = None
    grammar: tuple[str, str] | None = None  # a custom tool's (syntax, definition)

    def template_tool(self) -> dict[str, Any]:
        """The nested function shape templates read."""
        if self.kind == "custom":
            text = (self.description or "").strip()
            how = "free-form text, not JSON: the whole input goes in the `input` string"
            if self.grammar is not None:
                syntax, definition = self.grammar
                how += f"; it must match this {syntax} grammar:\n{definition}"
            function: dict[str, Any] = {
                "name": self.called,
                "description": f"{text}\n\nInput: {how}" if text else f"Input: {how}",
                "parameters": {
                    "type": "object",
                    "properties": {INPUT: {"type": "string", "description": "the tool's input, as raw text"}},
                    "required": [INPUT],
                },
            }
            return {"type": "function", "function": function}
        function = {"name": self.called, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if isinstance(self.description, str):
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@attrs.frozen
class ToolSet:
    specs: tuple[ToolSpec, ...] = ()

    def template_tools(self) -> list[dict[str, Any]]:
        return [spec.template_tool() for spec in self.specs]

    def resolve(self, called: str) -> ToolSpec | None:
        """The tool a model's call names: its prompt name, or a namespace tool's bare inner name
        when no other tool has that name (models drop the prefix)."""
        for spec in self.specs:
            if spec.called == called:
                return spec
        bare = [spec for spec in self.specs if spec.namespace is not None and spec.name == called]
        return bare[0] if len(bare) == 1 else None

    def called_name(self, name: str, namespace: str | None) -> str:
        """The prompt name of an item's (name, namespace), as history re-renders it."""
        return f"{namespace}.{name}" if namespace else name

    def forced_custom(self, choice: Any) -> ToolSpec | None:
        """The custom tool `tool_choice` forces ({"type": "custom", "name"}), or None. 400 when it
        names no custom tool of the request."""
        if not isinstance(choice, Mapping) or choice.get("type") != "custom":
            return None
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must be a string", param="tool_choice")
        spec = self.resolve(name)
        if spec is None or spec.kind != "custom":
            raise bad_request(f"tool_choice names {name!r}, which is not a custom tool in tools", param="tool_choice")
        return spec


def tool_set(tools: Any) -> ToolSet:
    """The request's callable tools (400 for a malformed function, custom or namespace tool)."""
    if tools is None:
        return ToolSet()
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", param="tools")
    specs: list[ToolSpec] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "namespace":
            namespace = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
                raise bad_request("a namespace tool needs a name and an array of tools", param="tools")
            specs += [s for t in inner if isinstance(t, Mapping) and (s := _spec(t, namespace)) is not None]
        elif (spec := _spec(tool, None)) is not None:
            specs.append(spec)
    called = [spec.called for spec in specs]
    if len(set(called)) != len(called):
        duplicate = next(name for name in called if called.count(name) > 1)
        raise bad_request(f"tools: {duplicate!r} is defined twice", param="tools")
    return ToolSet(tuple(specs))


def _spec(tool: Mapping[str, Any], namespace: str | None) -> ToolSpec | None:
    kind = tool.get("type")
    if kind not in ("function", "custom"):
        return None  # a built-in tool: dropped
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"a {kind} tool needs a name", param="tools")
    called = f"{namespace}.{name}" if namespace else name
    description = tool.get("description") if isinstance(tool.get("description"), str) else None
    if kind == "function":
        return ToolSpec(called, "function", name, namespace, description, tool.get("parameters"), tool.get("strict"))
    return ToolSpec(called, "custom", name, namespace, description, grammar=_grammar(tool.get("format"), name))


def _grammar(fmt: Any, name: str) -> tuple[str, str] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "grammar"):
        raise bad_request(f"tools: {name!r}: format.type must be 'text' or 'grammar'", param="tools")
    if fmt["type"] == "text":
        return None
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in GRAMMAR_SYNTAXES or not isinstance(definition, str) or not definition:
        raise bad_request(
            f"tools: {name!r}: a grammar format needs syntax 'lark' or 'regex' and a definition", param="tools"
        )
    return syntax, definition


def custom_input(arguments: str) -> str:
    """A custom tool's input from its call's whole arguments text: the `input` string (or the one
    string value) of the JSON object; anything else is the text itself."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get(INPUT), str):
            return value[INPUT]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments if not isinstance(value, str) else value


class InputStream:
    """A custom call's `input` decoded from its arguments' JSON text as the pieces arrive: `feed`
    returns the input text each piece completes (an escape split across pieces waits for its
    end). Pieces that do not open `{"input": "` stream nothing; `finish` then has the input,
    which the last delta completes."""

    def __init__(self) -> None:
        self._state = "head"  # head | in | done | other
        self._head = ""  # the text before the string opens
        self._pending = ""  # an escape not complete yet
        self._sent: list[str] = []
        self._raw: list[str] = []

    def feed(self, piece: str) -> str:
        self._raw.append(piece)
        if self._state == "head":
            self._head += piece
            match = _OPENING.match(self._head)
            if match is None:
                squeezed = re.sub(r"\s+", "", self._head)
                if not '{"input":"'.startswith(squeezed[:10]) or len(squeezed) >= 10:
                    self._state = "other"
                return ""
            self._state, piece = "in", self._head[match.end() :]
        if self._state != "in":
            return ""
        out = self._decode(self._pending + piece)
        self._sent.append(out)
        return out

    def _decode(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        self._pending = ""
        while i < n:
            char = text[i]
            if char == '"':
                self._state = "done"
                break
            if char != "\\":
                out.append(char)
                i += 1
                continue
            if i + 1 >= n:
                self._pending = text[i:]
                break
            code = text[i + 1]
            if code in _ESCAPES:
                out.append(_ESCAPES[code])
                i += 2
                continue
            if code != "u":
                out.append(code)  # not JSON: taken as the character it escapes
                i += 2
                continue
            if i + 6 > n:
                self._pending = text[i:]
                break
            unit = int(text[i + 2 : i + 6], 16) if re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2 : i + 6]) else 0xFFFD
            if 0xD800 <= unit < 0xDC00:  # a high surrogate: its pair follows
                if i + 12 > n:
                    self._pending = text[i:]
                    break
                low = text[i + 6 : i + 12]
                if re.fullmatch(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}", low):
                    out.append(chr(0x10000 + ((unit - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00)))
                    i += 12
                    continue
                unit = 0xFFFD
            out.append(chr(0xFFFD if 0xDC00 <= unit < 0xE000 else unit))
            i += 6
        return "".join(out)

    def finish(self) -> tuple[str, str]:
        """(the whole input, what of it no delta carried yet)."""
        sent = "".join(self._sent)
        if self._state in ("in", "done"):
            return sent, ""
        whole = custom_input("".join(self._raw))
        return whole, whole[len(sent) :] if whole.startswith(sent) else whole
