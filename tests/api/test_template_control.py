"""Template control on the real server over a tiny model: `--chat-template FILE`,
`--chat-template-args JSON`, per-request `chat_template_kwargs` (any variable) and `--thinking
on|off|auto`, each seen in the prompt /apply-template renders and the one generation feeds the
model; the prompt cache hits whenever the rendered prompt is the same."""

from __future__ import annotations

import pytest
import trio

from actors.preflight import check_template_file
from actors.startup import StartupFailed
from tests.realserver import CHAT, real_server

LIMIT_S = 120
MESSAGES = [{"role": "user", "content": "Tell me about tea."}]
GREETING_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}|{{ greeting | default('plain') }}]{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and enable_thinking %}"
    "<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture()
def template_file(tmp_path):
    path = tmp_path / "greeting.jinja"
    path.write_text(GREETING_TEMPLATE)
    return path


async def rendered(server, **extra) -> str:
    response = await server.client.post("/apply-template", json={"messages": MESSAGES, **extra})
    assert response.status_code == 200, await response.get_data()
    return (await response.get_json())["prompt"]


async def chat(server, **extra) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    response = await server.client.post(CHAT, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


async def test_chat_template_file_and_variables_shape_the_prompt(model_dir, template_file):
    with trio.fail_after(LIMIT_S):
        async with real_server(
            model_dir, chat_template=str(template_file), chat_template_args={"greeting": "hi"}
        ) as server:
            assert await rendered(server) == "[user|hi]Tell me about tea.\n[assistant]"
            own = await rendered(server, chat_template_kwargs={"greeting": "hola", "enable_thinking": True})
            assert own == "[user|hola]Tell me about tea.\n[assistant]<think>\n"
            # generation feeds the model exactly that prompt
            tokens = server.tokenizer.encode(own)
            usage = (await chat(server, chat_template_kwargs={"greeting": "hola", "enable_thinking": True}))["usage"]
            assert usage["prompt_tokens"] == len(tokens)
            response = await server.client.post("/tokenize", json={"messages": MESSAGES})
            assert (await response.get_json())["tokens"] == server.tokenizer.encode(
                "[user|hi]Tell me about tea.\n[assistant]"
            )


@pytest.mark.parametrize(("thinking", "expected"), [("off", "<think>\n\n</think>\n\n"), ("on", ""), ("auto", "")])
async def test_thinking_flag_is_the_default_enable_thinking(model_dir, thinking, expected):
    # The synthetic chatml template closes an empty think block when enable_thinking is false.
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, thinking=thinking) as server:
            prompt = await rendered(server)
            assert prompt.endswith("<|im_start|>assistant\n" + expected)
            # the request's own switch wins over the flag
            override = await rendered(server, chat_template_kwargs={"enable_thinking": thinking == "off"})
            flipped = "" if thinking == "off" else "<think>\n\n</think>\n\n"
            assert override.endswith("<|im_start|>assistant\n" + flipped)


async def test_the_prompt_cache_hits_when_the_rendered_prompt_is_the_same(model_dir, template_file):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, prompt_cache_bytes=64 << 20, chat_template=str(template_file)) as server:
            first = await chat(server, chat_template_kwargs={"greeting": "hi", "unused": 1})
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # Another variable the template never reads, the same variable from the other side:
            # the same prompt, so the same cache entry.
            again = await chat(server, chat_template_kwargs={"unused": 2, "greeting": "hi"})
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            other = await chat(server, chat_template_kwargs={"greeting": "yo"})
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < again["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt"])
async def test_a_variable_the_server_sets_is_a_400(model_dir, name):
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir) as server:
            body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {name: 1}}
            response = await server.client.post(CHAT, json=body)
            assert response.status_code == 400
            assert (await response.get_json())["error"]["param"] == "chat_template_kwargs"


def test_a_template_file_that_cannot_load_fails_start_up(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(StartupFailed, match="broken.jinja"):
        check_template_file(str(broken))
    with pytest.raises(StartupFailed, match="cannot be read"):
        check_template_file(str(tmp_path / "missing.jinja"))
