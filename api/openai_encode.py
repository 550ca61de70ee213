"""An admitted generation's text events → OpenAI chat-completion / text-completion objects, whole
or as `data:` chunks ending in `data: [DONE]`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from actors.request import GenerationFailed, RequestActor
from api.chat import Generation, StartedGeneration
from api.completion import collect
from api.errors import error_body
from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallsEvent
from api.wire import DONE_FRAME, data_frame, new_id
from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MASKED_LOGPROB = -9999.0  # what OpenAI reports for a candidate that could not be sampled


class ResponseMeta:
    """One response's id / created / model, shared by all its chunks."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = new_id(prefix, separator="-")
        self.created = int(time.time())
        self.model = model

    def envelope(self, object_name: str, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage is not None:
            payload["usage"] = usage
        return payload


def logprobs_block(actor: RequestActor[Event], generation: Generation, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """mlx_lm.server's `choices[0].logprobs` (NOT OpenAI's shape), or None.

    `top_logprobs > 0`: each entry is the top candidate merged with its top-k list (sorted
    descending, so the entry is the argmax), `token` the raw vocabulary piece; else
    `{id, logprob}` of the sampled token. One entry per generated token, EOS included.
    """
    if not generation.captures_logprobs:
        return None
    outs = actor.token_logprobs
    if not outs:
        return None
    if generation.sampling.top_logprobs > 0:
        content = []
        for out in outs:
            top = [
                {"id": t.token, "token": _piece(tokenizer, t.token), "logprob": _json_float(t.logprob)}
                for t in out.top_logprobs
            ]
            content.append({**top[0], "top_logprobs": top} if top else {})
        return {"content": content}
    return {"content": [{"id": out.token, "logprob": _json_float(out.logprob)} for out in outs]}


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    try:
        return tokenizer.id_to_token(token_id)
    except Exception:  # a padded-vocab id beyond the tokenizer, or a tokenizer double
        return ""


def _json_float(value: float | None) -> float | None:
    # JSON has no NaN / -Infinity; a masked (-inf) candidate reports OpenAI's floor instead.
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else MASKED_LOGPROB


def _failure_frame(exc: BaseException) -> bytes:
    return data_frame(error_body(str(exc), type="server_error"))


def _chat_delta(event: Event) -> dict[str, Any]:
    if isinstance(event, ToolCallsEvent):
        return {"tool_calls": [_tool_call(call, index=i) for i, call in enumerate(event.calls)]}
    return {event.kind: event.text}  # "content" | "reasoning"


def _tool_call(call: ToolCall, *, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **out} if index is not None else out


async def chat_stream(actor: RequestActor[Event], meta: ResponseMeta) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return data_frame(meta.envelope("chat.completion.chunk", choice, usage))

    try:
        yield chunk({"role": "assistant", "content": ""})
        while (events := await actor.next_events()) is not None:
            if events:  # one write for every token that was waiting: one chunk each
                yield b"".join([chunk(_chat_delta(event)) for event in events])
        yield chunk({}, actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:  # after the headers an exception would only truncate the body
        if not isinstance(exc, GenerationFailed):
            log.exception("chat stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def chat_whole(started: StartedGeneration, meta: ResponseMeta, tokenizer: Tokenizer) -> dict[str, Any]:
    done = await collect(started.actor)
    message: dict[str, Any] = {"role": "assistant", "content": done.content or (None if done.calls else "")}
    if done.reasoning:
        message["reasoning"] = done.reasoning
    if done.calls:
        message["tool_calls"] = [_tool_call(call) for call in done.calls]
    choice: dict[str, Any] = {"index": 0, "message": message}
    block = logprobs_block(started.actor, started.generation, tokenizer)
    if block is not None:
        choice["logprobs"] = block
    choice["finish_reason"] = done.finish_reason
    return meta.envelope("chat.completion", choice, done.usage)


async def text_stream(actor: RequestActor[Event], meta: ResponseMeta) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return data_frame(meta.envelope("text_completion", choice, usage))

    try:
        while (events := await actor.next_events()) is not None:
            # One chunk per text event (about one per token), all waiting ones in one write.
            frames = [chunk(e.text) for e in events if isinstance(e, TextDelta) and e.text]
            if frames:
                yield b"".join(frames)
        yield chunk("", actor.finish_reason, actor.usage())
        yield DONE_FRAME
    except Exception as exc:
        if not isinstance(exc, GenerationFailed):
            log.exception("completion stream failed")
        yield _failure_frame(exc)
    finally:
        actor.close()


async def text_whole(started: StartedGeneration, meta: ResponseMeta, tokenizer: Tokenizer) -> dict[str, Any]:
    done = await collect(started.actor)  # no think split or tools here: all text is content
    choice = {
        "index": 0,
        "text": done.content,
        "logprobs": logprobs_block(started.actor, started.generation, tokenizer),
        "finish_reason": done.finish_reason,
    }
    return meta.envelope("text_completion", choice, done.usage)
