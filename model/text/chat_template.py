"""Render Hugging Face chat templates (jinja2) the way transformers' apply_chat_template does.

Templates come from model directories, i.e. untrusted code, so they run in jinja2's immutable
sandbox. The environment mirrors transformers' (trim_blocks, lstrip_blocks, loopcontrols,
raise_exception, strftime_now, a non-HTML-escaping tojson, a namespace() that refuses
underscore attributes) so a template renders byte-identically to the reference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may arrive under; transformers copies it to all of them because
# templates disagree on which one they read (Qwen: reasoning_content, gpt-oss: thinking).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """A chat template failed to compile or render; the message is one line."""


class _TemplateRaised(Exception):
    # Distinguishes a template's own raise_exception() from jinja errors while rendering.
    pass


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's built-in tojson HTML-escapes <, >, & and ' which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # A dict() global that cannot be used to reach the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a sandbox-escape vector.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _plain(value: Any) -> Any:
    # A fresh copy made of JSON-like types: the template never sees (or aliases) caller objects.
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Prepare messages as transformers does before rendering.

    Keys whose value is None are dropped (OpenAI clients send `content: null` with tool calls and
    templates test for presence, not for None), and reasoning is aliased under every known name.
    """
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be objects, got {type(message).__name__}")
        message = {key: _plain(value) for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


class ChatTemplate:
    """One compiled chat template. Construction fails with TemplateError on a syntax error."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"chat template syntax error at line {exc.lineno}: {_one_line(exc.message or '')}"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """Render `messages`; `variables` (bos_token, enable_thinking, any chat_template_kwargs)
        become template variables."""
        context = {key: _plain(value) for key, value in variables.items()}
        plain_messages = normalize_messages(messages)
        try:
            return self._template.render(
                messages=plain_messages,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except _TemplateRaised as exc:
            raise TemplateError(_one_line(str(exc))) from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template error: {_one_line(str(exc))}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # Templates concatenating None or indexing past the end fail with plain Python errors.
            raise TemplateError(f"chat template error: {type(exc).__name__}: {_one_line(str(exc))}") from None
