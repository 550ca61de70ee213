"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request is translated into a typed chat request (api/anthropic/translate.py) and run
through the chat core (api/chat.py); only the encoding differs (api/anthropic/encode.py).
`anthropic-version` / `anthropic-beta` headers are accepted whatever their value (or absence).
Errors use the Anthropic envelope (the app's error handler dispatches /v1/messages* there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from quart import Blueprint, Response

from actors.handles import ServerHandles
from actors.request import GenerationFailed, RequestActor
from api.anthropic.encode import AnthropicStream
from api.anthropic.translate import count_request, messages_request
from api.chat import prompt_token_count, start_chat
from api.completion import (
    TIMED_OUT,
    Completion,
    add_events,
    collect,
    finish,
    log_stream_failure,
    next_events_or_timeout,
)
from api.http import offload
from api.http.wire import json_body, json_response, new_id, sse_response
from api.model_names import check_requested_model, model_handles, model_name
from api.pipeline.events import Event

PING_INTERVAL_S = 5.0
"""A `ping` event goes out after message_start and whenever this long passes without another
event (a long prefill), so clients and proxies with idle timeouts keep the stream open."""


def blueprint(server: ServerHandles) -> Blueprint:
    bp = Blueprint("anthropic", __name__)

    @bp.post("/v1/messages")
    async def messages() -> Response:
        handles = await model_handles(server)
        with handles.arrivals.arriving():
            adapters = check_requested_model(handles, await json_body())
            request = await offload.run(messages_request, await json_body(), vision=handles.info.vision)
            started = await start_chat(handles, request, adapters=adapters)
        message_id = new_id("msg")
        model = model_name(handles, adapters)
        stream = AnthropicStream(
            message_id=message_id,
            model=model,
            input_tokens=len(started.prompt),
            cached_tokens=started.actor.cached_tokens,  # known: the row opened before start_chat returned
            cache_created_tokens=started.actor.cache_created_tokens,
            frames=started.generation.stream,
        )
        if started.generation.stream:
            return sse_response(_stream(started.actor, stream))
        # The whole answer is the blocks its stream would have sent, from the same events.
        completion = await collect(started.actor, on_events=stream.add)
        return json_response(stream.message(completion), headers={"request-id": new_id("req")})

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        handles = await model_handles(server)
        check_requested_model(handles, await json_body())
        prompt = await offload.run(count_request, await json_body(), vision=handles.info.vision)
        # Tokenizer only, off the event loop: never the GPU worker, never admission.
        run = offload.to_thread if prompt.images else offload.run  # (decoding images: never on the loop)
        count = await run(prompt_token_count, handles, prompt)
        return json_response({"input_tokens": count})

    return bp


async def _stream(actor: RequestActor[Event], stream: AnthropicStream) -> AsyncIterator[bytes]:
    completion = Completion()
    try:
        yield stream.start()
        while True:
            events = await next_events_or_timeout(actor, PING_INTERVAL_S)
            if events is TIMED_OUT:
                yield stream.ping()
                continue
            if events is None:
                break
            add_events(completion, events)
            if frames := stream.add(events):
                yield frames
        finish(completion, actor)
        yield stream.finish(
            finish_reason=completion.finish_reason, matched_stop=completion.matched_stop, openai_usage=completion.usage
        )
    except Exception as exc:  # after the headers an exception would only truncate the body
        log_stream_failure(exc, "messages")
        # The protocol's error event ends the stream: as Anthropic's own, nothing follows it (a
        # message_stop after it would read as a normal end).
        client = isinstance(exc, GenerationFailed) and exc.status < 500  # the request's own constraint failed
        yield stream.error(
            str(exc) or type(exc).__name__, error_type="invalid_request_error" if client else "api_error"
        )
    finally:
        actor.close()
