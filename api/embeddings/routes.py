"""OpenAI embeddings: `POST /v1/embeddings`, for embedding models (model/load/embedding_config.py).

`{model, input, encoding_format?, dimensions?, user?}` → `{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`.
`input` is a string, an array of strings, an array of token ids, or an array of token-id arrays;
`encoding_format` "base64" gives each vector as little-endian float32 bytes, as OpenAI does.
`dimensions` keeps the first that many components, re-normalized (Matryoshka), on models whose
vectors are unit length. Embeddings do not pass the scheduler: the worker runs them as jobs of
their own between its calls (actors/gpu_worker.py `embed`).

An embedding model has no LM head to generate with, so it answers the generation routes 400
(`install_embedding_guard`); a generative model answers this route 400 in turn.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

import attrs
from quart import Blueprint, Response, request

from actors.admission import shutting_down
from actors.gpu_worker import WorkerDied
from actors.handles import ServerHandles
from actors.worker_api import NotAnEmbeddingModel
from api.chat import vocab_size
from api.errors import ApiError, bad_request, error_response_for, from_rejection
from api.http import offload
from api.http.wire import json_body, json_response
from api.model_names import check_requested_model, model_handles, model_name
from api.prompt_bounds import check_chars, too_long
from model.load.embedding_config import Pooling

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
ENCODINGS = ("float", "base64")
# The routes that generate: an embedding model answers them 400 (it has no LM head to sample from).
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
_INPUT_SHAPES = "a string, an array of strings, an array of token ids or an array of token-id arrays"


@attrs.frozen
class EmbeddingsRequest:
    texts: tuple[str, ...] | None  # strings to tokenize, or
    tokens: tuple[tuple[int, ...], ...] | None  # token ids as given
    base64: bool
    dimensions: int | None


def blueprint(server: ServerHandles) -> Blueprint:
    bp = Blueprint("embeddings", __name__)

    @bp.post("/v1/embeddings")
    async def embeddings() -> Response:
        body = await json_body()
        handles = await model_handles(server)
        if check_requested_model(handles, body, default_adapter=False):  # (adapters do not apply here)
            raise bad_request("LoRA adapters do not apply to embeddings", param="model")
        pooling = handles.info.embedding
        if pooling is None:
            raise bad_request("this model is not an embedding model", param="model", code="model_not_embedding")
        parsed = parse_request(body, pooling, vocab=vocab_size(handles.tokenizer))
        limit = handles.ceiling.max_safe_context or handles.info.context_length
        inputs = await offload.run(token_inputs, handles.tokenizer, parsed, context_length=limit)
        if handles.admission.closed:
            raise from_rejection(shutting_down())
        worker = handles.worker
        if worker is None:
            raise ApiError(503, "the model worker is not running", code="worker_unavailable")
        try:
            vectors = await worker.embed(inputs, dimensions=parsed.dimensions)
        except WorkerDied:
            raise ApiError(503, "the model worker is not running", code="worker_unavailable") from None
        except NotAnEmbeddingModel as exc:
            raise bad_request(str(exc), param="model", code="model_not_embedding") from None
        prompt_tokens = sum(len(t) for t in inputs)
        return json_response(response_body(vectors, parsed, model_name(handles), prompt_tokens), ensure_ascii=True)

    return bp


def install_embedding_guard(app: Any, handles: ServerHandles) -> None:
    """On an embedding model, the generation routes answer 400 in their own envelope (after the
    security gate, which registers first)."""

    @app.before_request
    async def embedding_only() -> Response | None:
        if request.method != "POST" or request.path not in GENERATION_PATHS:
            return None
        model = handles if handles.pool is None else await _named_model(handles)
        if model is None or model.info.embedding is None:
            return None
        error = bad_request(
            "this model is an embedding model: it serves /v1/embeddings only",
            param="model",
            code="model_not_generative",
        )
        return error_response_for(request.path, error)


async def _named_model(server: ServerHandles) -> ServerHandles | None:
    """With a model pool: the resident model the request names (a model not loaded yet is
    judged by its own routes once it has loaded)."""
    assert server.pool is not None
    body = await request.get_json(force=True, silent=True)
    name = body.get("model") if isinstance(body, dict) else None
    model_id = server.pool.find(name) if isinstance(name, str) and name else server.info.name
    return None if model_id is None else server.pool.resident(model_id)


def parse_request(body: dict[str, Any], pooling: Pooling, *, vocab: int | None) -> EmbeddingsRequest:
    """The body's fields, validated (400 with `param` naming the bad one)."""
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODINGS)}", param="encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", param="user")
    texts, tokens = _inputs(body.get("input"), vocab)
    return EmbeddingsRequest(
        texts=texts, tokens=tokens, base64=encoding == "base64", dimensions=_dimensions(body, pooling)
    )


def _dimensions(body: dict[str, Any], pooling: Pooling) -> int | None:
    dimensions = body.get("dimensions")
    if dimensions is None:
        return None
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
        raise bad_request("dimensions must be a positive integer", param="dimensions")
    if not pooling.truncatable:
        raise bad_request("this model does not support dimensions (its vectors are not normalized)", param="dimensions")
    if dimensions > pooling.dimensions:
        raise bad_request(f"dimensions must be at most {pooling.dimensions} for this model", param="dimensions")
    return dimensions


def _inputs(value: Any, vocab: int | None) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...], ...] | None]:
    if value is None:
        raise bad_request("input is required", param="input")
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise bad_request(f"input must be {_INPUT_SHAPES}", param="input")
    if not value:
        raise bad_request("input must not be empty", param="input")
    if all(_is_token(v) for v in value):
        value = [value]  # one input given as token ids
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds {len(value)} items, more than {MAX_INPUTS}", param="input")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise bad_request("input must not contain empty strings", param="input")
        return tuple(value), None
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        for ids in value:
            bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary", param="input")
        return None, tuple(tuple(ids) for ids in value)
    raise bad_request(f"input must be {_INPUT_SHAPES} (none empty)", param="input")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_inputs(tokenizer: Any, parsed: EmbeddingsRequest, *, context_length: int) -> list[list[int]]:
    """Each input's token ids (strings tokenized with the tokenizer's own special tokens, as
    sentence-transformers does); 400 for one that is empty or cannot fit the context."""
    if parsed.tokens is not None:
        inputs = [list(ids) for ids in parsed.tokens]
    else:
        assert parsed.texts is not None
        for text in parsed.texts:  # refuse megabytes before tokenizing them
            check_chars(len(text), tokenizer=tokenizer, context_length=context_length, param="input")
        inputs = [list(tokenizer.encode(text)) for text in parsed.texts]
    for index, ids in enumerate(inputs):
        if not ids:
            raise bad_request(f"input {index} has no tokens", param="input")
        if context_length > 0 and len(ids) > context_length:
            raise too_long(f"input {index} is {len(ids)} tokens and", context_length, "input")
    return inputs


def response_body(
    vectors: Sequence[Sequence[float]], parsed: EmbeddingsRequest, model: str, prompt_tokens: int
) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": encode_base64(vector) if parsed.base64 else list(vector)}
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def encode_base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI sends for encoding_format "base64"."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
