"""OpenAI Responses routes: POST /v1/responses, GET / DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items.

A Responses request is resolved against the store (`previous_response_id`: stored input +
stored output re-fed as input, reasoning dropped, instructions carried forward unless
replaced), translated into a typed chat request (api/responses/translate.py) and run through
the chat core (api/chat.py); only the encoding differs (api/responses/encode.py). The finished
Response object is stored under its id unless the request says `store: false` (failed streams
are never stored; with a durable store it is on disk before the final event or the body goes
out: api/responses/store.py `Responses`). Errors use the Responses shape (the app's error handler dispatches
/v1/responses* there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from quart import Blueprint, Response, request

from actors.handles import ServerHandles
from actors.request import GenerationFailed, RequestActor
from actors.ssd.response_log import store_ttl
from api.chat import start_chat, vocab_size
from api.completion import (
    TIMED_OUT,
    Completion,
    add_events,
    collect,
    finish,
    log_stream_failure,
    next_events_or_timeout,
)
from api.errors import ApiError, bad_request
from api.http import offload
from api.http.wire import KEEPALIVE_FRAME, KEEPALIVE_INTERVAL_S, json_body, json_response, sse_response
from api.model_names import check_requested_model, model_handles, model_name
from api.pipeline.events import Event
from api.responses.encode import ResponseMeta, ResponsesStream
from api.responses.items import output_to_input, stored_input
from api.responses.store import Responses, ResponseStore, StoredResponse
from api.responses.tools import tool_set
from api.responses.translate import input_items, responses_request

DEFAULT_PAGE, MAX_PAGE = 20, 100  # input_items page sizes, OpenAI's


def blueprint(server: ServerHandles) -> Blueprint:
    bp = Blueprint("responses", __name__)
    durable = server.responses  # the durable store (actors/ssd/response_log.py), or None
    ttl = store_ttl(server.options.responses, durable=durable is not None)
    store = Responses(ResponseStore(ttl_s=ttl), durable)
    server.stats_blocks["responses_store"] = store.stats  # /stats and /metrics show what it holds

    @bp.post("/v1/responses")
    async def create() -> Response:
        handles = await model_handles(server)
        with handles.arrivals.arriving():
            body = await json_body()
            adapters = check_requested_model(handles, body)
            previous_id = body.get("previous_response_id")
            items = await offload.run(input_items, body.get("input"))
            instructions = body.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise bad_request("instructions must be a string", param="instructions")
            if previous_id is not None:
                if not isinstance(previous_id, str):
                    raise bad_request("previous_response_id must be a string", param="previous_response_id")
                previous = await store.get(previous_id)
                if previous is None:
                    raise ApiError(
                        404,
                        f"previous_response_id '{previous_id}' not found or expired",
                        param="previous_response_id",
                        code="previous_response_not_found",
                    )
                items = [*previous.input, *output_to_input(previous.output), *items]
                if instructions is None:
                    instructions = previous.instructions
            keep = body.get("store", True) is not False
            request = await offload.run(
                responses_request,
                body,
                items,
                instructions,
                vocab_size=vocab_size(handles.tokenizer),
                vision=handles.info.vision,
            )
            started = await start_chat(handles, request, adapters=adapters)
        toolset = tool_set(body.get("tools"))  # (checked by the translation)
        forced = toolset.forced_custom(body.get("tool_choice"))
        grammar_forced = forced if forced is not None and forced.grammar is not None else None
        meta = ResponseMeta(
            body,
            model=model_name(handles, adapters),
            instructions=instructions,
            previous_response_id=previous_id,
            store=keep,
        )

        async def remember(final: dict[str, Any]) -> None:
            if keep and final["status"] != "failed":  # durable (with a durable store) once this returns
                kept = stored_input(items)
                await store.put(
                    final["id"], input=kept, output=final["output"], instructions=instructions, response=final
                )

        if started.generation.stream:
            return sse_response(
                _stream(started.actor, ResponsesStream(meta, tools=toolset, forced=grammar_forced), remember)
            )
        # The whole answer is the items its stream would have sent, from the same events.
        builder = ResponsesStream(meta, frames=False, tools=toolset, forced=grammar_forced)
        final = builder.response(await collect(started.actor, on_events=builder.add))
        await remember(final)
        return json_response(final)

    @bp.get("/v1/responses/<response_id>")
    async def retrieve(response_id: str) -> Response:
        return json_response((await _stored(store, response_id)).response)

    @bp.get("/v1/responses/<response_id>/input_items")
    async def input_items_list(response_id: str) -> Response:
        entry = await _stored(store, response_id)
        return json_response(input_items_page(entry.input, request.args))

    @bp.delete("/v1/responses/<response_id>")
    async def delete(response_id: str) -> Response:
        if not await store.delete(response_id):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    return bp


def input_items_page(items: list[dict[str, Any]], args: Mapping[str, str]) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI lists them: `order` (`desc`, the
    default, or `asc`), `limit` (1 to 100, default 20) and `after` (the id the previous page
    ended at)."""
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    limit_arg = args.get("limit", str(DEFAULT_PAGE))
    # Bounded before int(): past 4300 digits int() raises (a 500), and no page is that long anyway.
    digits = limit_arg.isascii() and limit_arg.isdigit() and len(limit_arg) <= len(str(MAX_PAGE))
    limit = int(limit_arg) if digits else 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = args.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "has_more": len(ordered) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


async def _stored(store: Responses, response_id: str) -> StoredResponse:
    entry = await store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"response '{response_id}' not found or expired", code="not_found")


async def _stream(
    actor: RequestActor[Event], stream: ResponsesStream, remember: Callable[[dict[str, Any]], Awaitable[None]]
) -> AsyncIterator[bytes]:
    completion = Completion()
    try:
        yield stream.start()
        while True:
            events = await next_events_or_timeout(actor, KEEPALIVE_INTERVAL_S)
            if events is TIMED_OUT:  # a long prefill: keep the proxies' idle timers off
                yield KEEPALIVE_FRAME
                continue
            if events is None:
                break
            add_events(completion, events)
            if frames := stream.add(events):
                yield frames
        finish(completion, actor)
        closing, final = stream.finish(
            finish_reason=completion.finish_reason, openai_usage=completion.usage, reasoning=completion.reasoning
        )
        await remember(final)  # before response.completed: a client may continue from it at once
        yield closing
    except Exception as exc:  # after the headers an exception would only truncate the body
        log_stream_failure(exc, "responses")
        message = str(exc) or type(exc).__name__
        status = exc.status if isinstance(exc, GenerationFailed) else 500  # 400: the request's own constraint
        error = stream.error(message, status=status)  # the protocol's error event, then its normal closing frames
        closing, _ = stream.finish(
            finish_reason="stop",
            openai_usage=actor.usage(),
            reasoning=completion.reasoning,
            error=message,
            error_status=status,
        )
        yield error + closing
    finally:
        actor.close()
