"""The tokenizer and the chat template over HTTP, as vLLM serves them: `POST /tokenize`,
`POST /detokenize`, `POST /apply-template`. None of them touches the model worker.

* `/tokenize` `{"model", "prompt", "add_special_tokens"?}` (the text as /v1/completions encodes
  it) or `{"model", "messages", "tools"?, "chat_template_kwargs"?, "reasoning_effort"?,
  "add_generation_prompt"?}` (the prompt /v1/chat/completions feeds the model, rendered by the
  same chat core) → `{"tokens", "count", "max_model_len"}`, plus `"token_strs"` (each id's
  vocabulary piece) with `"return_token_strs": true`.
* `/detokenize` `{"model", "tokens"}` → `{"prompt"}`: the ids decoded (special tokens kept).
* `/apply-template` `{"model"?, "messages", "tools"?, "chat_template_kwargs"?,
  "reasoning_effort"?, "add_generation_prompt"?}` → `{"prompt"}`: the rendered template text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.handles import ServerHandles
from api.chat import RenderedPrompt, render_chat_prompt, vocab_size
from api.chat_request import ChatPrompt
from api.errors import bad_request
from api.fields import flag, reasoning_options
from api.openai.translate import chat_messages, tools_field
from api.prompt_bounds import check_chars


def tokenize(handles: ServerHandles, body: Mapping[str, Any]) -> dict[str, Any]:
    """`/tokenize`'s answer (blocking: run it off the event loop). Raises ApiError (400)."""
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("give either prompt (a string) or messages", param="prompt")
    tokenizer = handles.tokenizer
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", param="prompt")
        check_chars(len(prompt), tokenizer=tokenizer, context_length=handles.info.context_length, param="prompt")
        special = flag(body.get("add_special_tokens"), "add_special_tokens")
        tokens = tokenizer.encode(prompt, add_special_tokens=special is not False)
    else:
        tokens = _rendered(handles, body).tokens
    answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": handles.info.context_length}
    if flag(body.get("return_token_strs"), "return_token_strs"):
        answer["token_strs"] = [_piece(handles, token) for token in tokens]
    return answer


def detokenize(handles: ServerHandles, body: Mapping[str, Any]) -> dict[str, Any]:
    """`/detokenize`'s answer. Raises ApiError (400) for ids that are not the vocabulary's."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be an array of token ids", param="tokens")
    vocab = vocab_size(handles.tokenizer)
    bad = next((t for t in tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range (vocabulary size {vocab})", param="tokens")
    return {"prompt": handles.tokenizer.decode(tokens)}


def apply_template(handles: ServerHandles, body: Mapping[str, Any]) -> dict[str, Any]:
    """`/apply-template`'s answer: the prompt text the chat routes would render."""
    return {"prompt": _rendered(handles, body).text or ""}


def _rendered(handles: ServerHandles, body: Mapping[str, Any]) -> RenderedPrompt:
    """The messages, tools and template switches of `body` rendered as the chat routes render them."""
    messages = chat_messages(body.get("messages"))
    tools = tools_field(body.get("tools"))
    reasoning = reasoning_options(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
    generation_prompt = flag(body.get("add_generation_prompt"), "add_generation_prompt")
    prompt = ChatPrompt(messages=messages, tools=tuple(tools) if tools else None, reasoning=reasoning)
    return render_chat_prompt(handles, prompt, generation_prompt=generation_prompt is not False)


def _piece(handles: ServerHandles, token: int) -> str:
    try:
        return handles.tokenizer.id_to_token(token)
    except ValueError:  # a padded-vocabulary id past the tokenizer's
        return ""
