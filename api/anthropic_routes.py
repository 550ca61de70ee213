"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens (spec §1.4, §1.17).

A Messages request is translated into an OpenAI-chat body and run through `start_chat`, the one
chat pipeline; only the encoding differs. `anthropic-version` / `anthropic-beta` headers are
accepted whatever their value (or absence). Errors use the Anthropic envelope
`{"type": "error", "error": {"type", "message"}}` with the status of the underlying error (the
app's error handler dispatches /v1/messages* here).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response

from api import openai_routes
from api.anthropic_translate import AnthropicStream, anthropic_to_chat, message_object
from api.protocol_common import (
    TIMED_OUT,
    Completion,
    add_events,
    collect,
    finish,
    json_body,
    json_response,
    log_stream_failure,
    new_id,
    next_events_or_timeout,
    sse_response,
)

log = logging.getLogger(__name__)

PATH_PREFIX = "/v1/messages"
PING_INTERVAL_S = 5.0
"""A `ping` event goes out after message_start and whenever this long passes without another
event (a long prefill), so clients and proxies with idle timeouts keep the stream open."""


def blueprint(handles: Any) -> Blueprint:
    bp = Blueprint("anthropic", __name__)

    @bp.post("/v1/messages")
    async def messages() -> Response:
        with handles.arrivals.arriving():
            chat = anthropic_to_chat(await json_body())
            started = await openai_routes.start_chat(handles, chat)
        message_id = new_id("msg")
        model = handles.info.name
        if started.gen.stream:
            stream = AnthropicStream(message_id=message_id, model=model, input_tokens=len(started.prompt))
            return sse_response(_stream(started.actor, stream))
        completion = await collect(started.actor)
        return json_response(
            message_object(completion, message_id=message_id, model=model), headers={"request-id": new_id("req")}
        )

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        chat = anthropic_to_chat(await json_body(), for_count=True)
        # Tokenizer only, off the event loop: never the GPU worker, never admission.
        count = await trio.to_thread.run_sync(prompt_token_count, handles, chat)
        return json_response({"input_tokens": count})

    return bp


def prompt_token_count(handles: Any, chat: dict[str, Any]) -> int:
    """The length of the prompt `start_chat` renders for this chat body.

    Built from start_chat's own steps (message normalisation, tool / thinking options, template
    kwargs, render + encode), minus sampling validation and admission; tests pin
    count == usage so any divergence shows up at once.
    """
    messages = openai_routes._chat_messages(chat)
    options = openai_routes.parse_chat_options(chat)
    tools = list(options.tools) if options.tools else None
    kwargs = openai_routes._template_kwargs(handles.tokenizer, tools, options.template_kwargs)
    prompt, _ = openai_routes._render_prompt(handles.tokenizer, messages, tools, kwargs)
    return len(prompt)


async def _stream(actor: Any, stream: AnthropicStream) -> AsyncIterator[bytes]:
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
        # The protocol's error event, then its normal closing frames (spec §1.17).
        yield stream.error(str(exc) or type(exc).__name__) + stream.finish(
            finish_reason="stop", matched_stop=None, openai_usage=actor.usage()
        )
    finally:
        actor.close()
