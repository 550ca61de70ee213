"""Chat-template rendering must equal transformers' apply_chat_template byte for byte."""

# The templates below are real checkpoints' chat templates, kept verbatim (long lines included).
# ruff: noqa: E501

from __future__ import annotations

import copy
import datetime

import pytest
from _tok_helpers import hf_tokenizer, make_tokenizer_dir

from model.text.chat_template import ChatTemplate, TemplateError
from model.text.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — «quoted» <tags> & ümlauts",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "I am a small model. 😀"},
    {"role": "user", "content": "Tell me a joke about Zürich."},
]
THINKING_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nthree and three\n</think>\n\n6"},
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris, in celsius?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 °C and clear in Paris."},
    {"role": "user", "content": "And in Tokyo?"},
]
TWO_TOOL_CALLS = [
    {"role": "user", "content": "Weather in Rome and news about it?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "I need two tools.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Rome news"}}},
        ],
    },
    {"role": "tool", "content": "18 °C"},
    {"role": "tool", "content": "Nothing new."},
]

# Qwen3's chat template (Qwen/Qwen3-*), as published in tokenizer_config.json.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.1-Instruct's chat template (meta-llama/Llama-3.1-8B-Instruct).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Exercises what the two above don't: break/continue, dict(), tojson options, strftime_now and
# a caller-supplied variable.
LOOP_CONTROL_TEMPLATE = r"""{%- set seen = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if seen.count >= max_turns | default(99) %}{% break %}{% endif %}
    {%- set seen.count = seen.count + 1 %}
[{{ loop.index }}] {{ message.role }}: {{ message.content }}
{% endfor %}
{{- dict(a=1, b=[1, 2]) | tojson(separators=(',', ':'), sort_keys=true) }}
{{- tools | tojson(indent=2) if tools else '' }}
year={{ strftime_now('%Y') }}
{%- if add_generation_prompt %}
<assistant>{{ eos_token }}{% endif %}"""


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("chatml"), kind="bpe", template="chatml")


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("llama3"), kind="bpe", template="llama3")


def _both(path, messages, *, template=None, tools=None, add_generation_prompt=True, **kwargs):
    ours_tok = Tokenizer.from_dir(path)
    hf = hf_tokenizer(path)
    hf_kwargs = dict(kwargs)
    if template is not None:
        ours = ChatTemplate(template).render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**ours_tok.template_tokens, **kwargs},
        )
        hf_kwargs["chat_template"] = template
    else:
        ours = ours_tok.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    reference = hf.apply_chat_template(
        copy.deepcopy(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **hf_kwargs
    )
    return ours, reference


CASES = {
    "multi_turn": dict(messages=MULTI_TURN),
    "multi_turn_no_prompt": dict(messages=MULTI_TURN[:3], add_generation_prompt=False),
    "thinking_off": dict(messages=MULTI_TURN, enable_thinking=False),
    "thinking_on": dict(messages=MULTI_TURN, enable_thinking=True),
    "thinking_history": dict(messages=THINKING_HISTORY, add_generation_prompt=False),
    "thinking_history_prompt": dict(messages=THINKING_HISTORY + [{"role": "user", "content": "ok?"}]),
    "tools": dict(messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL, SEARCH_TOOL]),
    "tools_no_system": dict(messages=TOOL_CONVERSATION[1:], tools=[WEATHER_TOOL]),
    "tools_thinking_off": dict(messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL], enable_thinking=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chatml_fixture_matches_transformers(chatml_dir, case):
    ours, reference = _both(chatml_dir, **CASES[case])
    assert ours == reference


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_qwen3_template_matches_transformers(chatml_dir, case):
    ours, reference = _both(chatml_dir, template=QWEN3_TEMPLATE, **CASES[case])
    assert ours == reference


def test_chatml_two_tool_calls_with_string_and_dict_arguments(chatml_dir):
    ours, reference = _both(chatml_dir, messages=TWO_TOOL_CALLS, tools=[WEATHER_TOOL, SEARCH_TOOL])
    assert ours == reference
    assert '"arguments": {"query": "Rome news"}' in ours
    assert "<tool_response>\n18 °C\n</tool_response>\n<tool_response>\nNothing new." in ours


def test_enable_thinking_false_emits_empty_think_block(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    off = tok.render_chat(MULTI_TURN, enable_thinking=False)
    on = tok.render_chat(MULTI_TURN, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


LLAMA_CASES = {
    "multi_turn": dict(messages=MULTI_TURN),
    "multi_turn_no_prompt": dict(messages=MULTI_TURN[:3], add_generation_prompt=False),
    "tools": dict(messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL]),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_fixture_matches_transformers(llama3_dir, case):
    ours, reference = _both(llama3_dir, **LLAMA_CASES[case])
    assert ours == reference
    assert ours.startswith("<|begin_of_text|>")


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_real_llama31_template_matches_transformers(llama3_dir, case):
    ours, reference = _both(llama3_dir, template=LLAMA31_TEMPLATE, **LLAMA_CASES[case])
    assert ours == reference


def test_llama31_template_variables_pass_through(llama3_dir):
    ours, reference = _both(
        llama3_dir,
        messages=MULTI_TURN,
        template=LLAMA31_TEMPLATE,
        tools=[WEATHER_TOOL],
        tools_in_user_message=False,
        date_string="01 Jan 2030",
    )
    assert ours == reference
    assert "Today Date: 01 Jan 2030" in ours


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
@pytest.mark.parametrize("max_turns", [1, 2, 10])
def test_loop_controls_namespace_tojson_and_strftime_match_transformers(chatml_dir, tools, max_turns):
    ours, reference = _both(
        chatml_dir, messages=MULTI_TURN, template=LOOP_CONTROL_TEMPLATE, tools=tools, max_turns=max_turns
    )
    assert ours == reference
    assert ours.count("] ") == min(max_turns, 3)
    assert str(datetime.date.today().year) in ours


def test_raise_exception_surfaces_as_template_error(llama3_dir):
    tok = Tokenizer.from_dir(llama3_dir)
    two_calls_for_llama = TWO_TOOL_CALLS[:2]
    with pytest.raises(TemplateError, match="only supports single tool-calls"):
        ChatTemplate(LLAMA31_TEMPLATE).render(two_calls_for_llama, **tok.template_tokens)


def test_fixture_template_rejects_unknown_role(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    with pytest.raises(TemplateError, match="Unknown message role: narrator"):
        tok.render_chat([{"role": "narrator", "content": "Once upon a time"}])


def test_syntax_error_is_one_line_template_error():
    with pytest.raises(TemplateError) as info:
        ChatTemplate("{% for m in messages %}{{ m.content }")
    message = str(info.value)
    assert "syntax error" in message and "line 1" in message
    assert "\n" not in message


def test_runtime_type_error_is_template_error():
    with pytest.raises(TemplateError, match="chat template error"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([])


def test_tojson_keeps_non_ascii_and_html_characters():
    out = ChatTemplate("{{ tools | tojson }}").render([], tools=[{"d": "<b>ü & 'q'</b>"}])
    assert out == '[{"d": "<b>ü & \'q\'</b>"}]'


def test_render_does_not_mutate_caller_messages(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    messages = copy.deepcopy(TOOL_CONVERSATION)
    tok.render_chat(messages, tools=[WEATHER_TOOL])
    assert messages == TOOL_CONVERSATION


# Gemma 3's template (its tokenizer_config.json): turns as <start_of_turn>user / model, the system
# prompt folded into the first user turn, and raise_exception when roles do not alternate.
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@pytest.mark.parametrize("case", ["multi_turn", "multi_turn_no_prompt"])
def test_gemma3_template_matches_transformers(chatml_dir, case):
    ours, reference = _both(chatml_dir, template=GEMMA3_TEMPLATE, **CASES[case])
    assert ours == reference and "<start_of_turn>model\n" in ours


def test_gemma3_template_refuses_roles_that_do_not_alternate():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="alternate"):
        ChatTemplate(GEMMA3_TEMPLATE).render(messages, add_generation_prompt=True, bos_token="<bos>")
