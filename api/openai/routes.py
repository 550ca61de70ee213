"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /stats.

Each completion handler translates its body (api/openai/translate.py), admits it through the
chat core (api/chat.py) before answering, so 400 / 503 are real HTTP statuses, then encodes the
actor's text events as one JSON body or an SSE stream (api/openai/encode.py).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, current_app

from actors.handles import ServerHandles
from api.chat import start_chat, start_text, text_prompt_tokens, vocab_size
from api.chat_request import TextRequest
from api.http import offload
from api.http.wire import json_body, json_response, sse_response
from api.model_names import (
    adapter_model_names,
    check_requested_model,
    model_handles,
    model_name,
    model_not_found,
    served_names,
)
from api.openai import encode as openai_encode
from api.openai.prompt_logprobs import score_prompt
from api.openai.translate import chat_request, completion_output, text_request
from api.pool_cards import pool_card, pool_cards
from model.text import grammar

HEALTH_BODY = b'{"status": "ok"}'  # byte parity with mlx_lm.server, space included
OWNER = "mlx-trio"


def blueprint(server: ServerHandles) -> Blueprint:
    bp = Blueprint("openai", __name__)

    def answer(payload: Any) -> Response:
        return json_response(payload, ensure_ascii=True)

    @bp.get("/health")
    async def health() -> Response:
        return Response(HEALTH_BODY, content_type="application/json")

    @bp.get("/stats")
    async def stats() -> Response:
        return answer(_stats(server))

    @bp.get("/v1/models")
    async def models() -> Response:
        if server.pool is not None:  # every servable model, with its status
            return answer({"object": "list", "data": pool_cards(server, server.pool, _model_card, adapter_card)})
        cards = [_model_card(server, name) for name in served_names(server)]
        cards += [adapter_card(server, name, parent) for name, parent in adapter_model_names(server)]
        return answer({"object": "list", "data": cards})

    @bp.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if server.pool is not None:
            return answer(pool_card(server, server.pool, model_id, _model_card, adapter_card))
        adapters = dict(adapter_model_names(server))
        if model_id in adapters:
            return answer(adapter_card(server, model_id, adapters[model_id]))
        if model_id not in served_names(server):
            raise model_not_found(server, model_id)
        return answer(_model_card(server, model_id))

    @bp.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        handles = await model_handles(server)
        with handles.arrivals.arriving():
            adapters = check_requested_model(handles, await json_body())
            vocab = vocab_size(handles.tokenizer)
            request = await offload.run(chat_request, await json_body(), vocab_size=vocab, vision=handles.info.vision)
            started = await start_chat(handles, request, adapters=adapters)
        meta = openai_encode.ResponseMeta("chatcmpl", model_name(handles, adapters))
        if started.generation.stream:
            usage = request.generation.include_usage
            stream = openai_encode.chat_stream(started, meta, handles.tokenizer, include_usage=usage)
            return sse_response(stream)
        return answer(await openai_encode.chat_whole(started, meta, handles.tokenizer))

    @bp.post("/v1/completions")
    async def completions() -> Response:
        handles = await model_handles(server)
        with handles.arrivals.arriving():
            adapters = check_requested_model(handles, await json_body())
            request = await offload.run(text_request, await json_body(), vocab_size=vocab_size(handles.tokenizer))
            output = completion_output(await json_body())
            echo = await offload.run(_echo_text, handles, request) if output.echo else ""
            scored = None
            if output.prompt_logprobs is not None:  # echo with logprobs: the prompt's tokens scored
                prompt = await offload.run(text_prompt_tokens, handles, request)
                scored = await score_prompt(handles, prompt, top=output.prompt_logprobs, adapters=adapters)
            started = await start_text(handles, request, adapters=adapters) if output.generate else None
        meta = openai_encode.ResponseMeta("cmpl", model_name(handles, adapters))
        tokens = openai_encode.TokenNames(handles.tokenizer, as_ids=output.token_ids)
        usage = request.generation.include_usage
        if started is None:  # max_tokens 0: the prompt's scores alone
            assert scored is not None
            n = request.generation.n
            if request.generation.stream:
                only = openai_encode.scored_stream(scored, meta, tokens, echo=echo, n=n, include_usage=usage)
                return sse_response(only)
            return answer(openai_encode.scored_whole(scored, meta, tokens, echo=echo, n=n))
        if started.generation.stream:
            stream = openai_encode.text_stream(started, meta, tokens, include_usage=usage, echo=echo, scored=scored)
            return sse_response(stream)
        return answer(await openai_encode.text_whole(started, meta, tokens, echo=echo, scored=scored))

    return bp


def _echo_text(handles: ServerHandles, request: TextRequest) -> str:
    """`echo`'s prompt text: the prompt string, or its token ids decoded."""
    if isinstance(request.prompt, str):
        return request.prompt
    return handles.tokenizer.decode(list(request.prompt))


def _stats(handles: ServerHandles) -> dict[str, Any]:
    stats = handles.stats()
    stats.setdefault("server", {}).setdefault("owner", OWNER)
    if (batch := stats.get("batch")) is not None:  # (none while a model pool's default model is not resident)
        batch.setdefault("kv_budget_bytes", max(0, handles.ceiling.usable_bytes))
    return stats


def adapter_card(handles: ServerHandles, model_id: str, parent: str) -> dict[str, Any]:
    """A mounted LoRA adapter as /v1/models lists it (vLLM's shape: `parent` is the base)."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(handles.started_at),
        "owned_by": OWNER,
        "parent": parent,
    }


def _model_card(handles: ServerHandles, model_id: str) -> dict[str, Any]:
    routes = {rule.rule for rule in current_app.url_map.iter_rules()}
    reasoning = handles.tokenizer.has_thinking
    structured_output = grammar.available()
    defaults = handles.sampling_defaults
    embeddings = handles.info.embedding is not None  # an embedding model serves /v1/embeddings only
    capabilities = {
        "chat_completions": not embeddings,
        "text_completions": not embeddings,
        "anthropic_messages": "/v1/messages" in routes,
        "responses": "/v1/responses" in routes,
        "streaming": True,
        "tools": True,
        "structured_output": structured_output,
        "logprobs": True,
        "embeddings": embeddings,
        "vision": handles.info.vision,
        "video": handles.info.video_processor is not None,
        "audio": handles.info.audio_processor is not None,
        "adapters": True,
        "training": False,
    }
    return {
        "id": model_id,
        "object": "model",
        "created": int(handles.started_at),
        "owned_by": OWNER,
        "context_window": handles.info.context_length,
        "max_safe_context": handles.ceiling.max_safe_context,
        "reasoning": reasoning,
        "vision": handles.info.vision,
        "video": handles.info.video_processor is not None,
        "audio": handles.info.audio_processor is not None,
        "batch_mode": handles.mode,
        "kv_scheme": handles.info.kv_scheme,  # how the KV cache is stored: bf16, kv8, kv4, ...
        "tools": True,
        "structured_output": structured_output,
        "embeddings": embeddings,
        "adapters": True,
        "training": False,
        "capabilities": capabilities,
        "gen_defaults": {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k},
        **_failed(handles),
    }


def _failed(handles: ServerHandles) -> dict[str, Any]:
    """A model whose isolated engine failed for good says so (a pool's listing: its entry's status)."""
    failure = handles.worker_failure()
    return {} if failure is None else {"status": "failed", "error": failure}
