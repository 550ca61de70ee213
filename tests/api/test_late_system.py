"""System messages after the first one: rendered in place where the template can, else joined to
the system prompt (api/chat.py `render_prompt`, api/template_messages.py `join_late_system`)."""

from __future__ import annotations

from typing import Any

import pytest

from api.chat import render_prompt
from api.chat_request import ChatPrompt
from api.errors import ApiError
from api.template_messages import join_late_system
from model.text.chat_template import ChatTemplate

# Renders a system message anywhere (as Qwen's and Llama 3's templates do).
IN_PLACE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Takes a leading system prompt and refuses any later one (as Mistral's and Gemma's do).
STRICT = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Renders only the leading system prompt and silently drops a later one.
DROPPING = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}<{{ m.role }}>{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


class TemplateTokenizer:
    """A tokenizer double: one template, characters as tokens."""

    def __init__(self, source: str) -> None:
        self.template = ChatTemplate(source)

    def chat_template(self, *, tools: Any = None) -> ChatTemplate:
        return self.template

    def render_chat(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True, **kw: Any) -> str:
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


CONVERSATION = (
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "hi"},
    {"role": "system", "content": "# Environment"},
    {"role": "assistant", "content": "hello"},
    {"role": "system", "content": "reminder"},
    {"role": "user", "content": "go"},
)


def test_a_template_that_can_renders_system_messages_where_they_are():
    rendered = render_prompt(TemplateTokenizer(IN_PLACE), ChatPrompt(messages=CONVERSATION))
    assert rendered.text == (
        "<system>You are an agent.<user>hi<system># Environment<assistant>hello<system>reminder<user>go<assistant>"
    )
    assert not rendered.joined_system


@pytest.mark.parametrize("source", [STRICT, DROPPING])
def test_otherwise_they_join_the_system_prompt_in_order(source):
    rendered = render_prompt(TemplateTokenizer(source), ChatPrompt(messages=CONVERSATION))
    assert (
        rendered.text
        == "<system>You are an agent.\n\n# Environment\n\nreminder<user>hi<assistant>hello<user>go<assistant>"
    )
    assert rendered.joined_system and rendered.messages[0]["role"] == "system"


def test_without_a_leading_system_prompt_one_is_made():
    messages = ({"role": "user", "content": "hi"}, {"role": "system", "content": "late"})
    assert join_late_system(messages) == [{"role": "system", "content": "late"}, {"role": "user", "content": "hi"}]
    rendered = render_prompt(TemplateTokenizer(STRICT), ChatPrompt(messages=messages))
    assert rendered.text == "<system>late<user>hi<assistant>"


def test_a_template_error_without_late_system_messages_is_still_a_400():
    broken = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ApiError) as info:
        render_prompt(TemplateTokenizer(broken), ChatPrompt(messages=({"role": "user", "content": "x"},)))
    assert info.value.status == 400 and "no tools here" in info.value.message
