"""An admitted generation's text events → OpenAI chat-completion / text-completion objects, whole
or as `data:` chunks ending in `data: [DONE]` (a stream that fails part-way sends an error frame
in OpenAI's error shape, then `data: [DONE]`, as vLLM does, so a client reading to [DONE] ends).

A request with `n` choices has one actor per choice; they are read in turn (the choices decode in
one batch, so waiting on one holds the others back by a step at most, and every row's channel
keeps being drained). Usage counts the prompt once and sums the choices' completions. A stream
carries usage only with `stream_options.include_usage`: then every chunk has `usage: null` and a
last chunk, with no choices, has the request's usage. A stream quiet for `KEEPALIVE_INTERVAL_S`
(a long prefill) sends an SSE comment, `: keep-alive`. Logprobs stream too: the chunks' pieces
concatenate to the whole answer's list (`chat_stream`, `text_stream`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from actors.request import GenerationFailed, RequestActor
from api.chat import Generation, StartedGeneration
from api.completion import TIMED_OUT, Completion, add_events, finish, next_events_or_timeout
from api.errors import ApiError, error_body
from api.http.wire import DONE_FRAME, KEEPALIVE_FRAME, KEEPALIVE_INTERVAL_S, data_frame, new_id
from api.openai.prompt_logprobs import ScoredPrompt
from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart
from model.engine.rows import TokenOut
from model.text.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

MASKED_LOGPROB = -9999.0  # what OpenAI reports for a candidate that could not be sampled


class ResponseMeta:
    """One response's id / created / model, shared by all its chunks."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = new_id(prefix, separator="-")
        self.created = int(time.time())
        self.model = model

    def envelope(
        self, object_name: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, *, usage_key: bool
    ) -> dict[str, Any]:
        """`usage_key`: the payload has a `usage` field (null when `usage` is None)."""
        payload = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_key or usage is not None:
            payload["usage"] = usage
        return payload


Choices = Sequence[RequestActor[Event]]


def usage(choices: Choices) -> dict[str, Any]:
    """The request's usage: its prompt once, every choice's completion tokens."""
    out = choices[0].usage()
    completion = sum(actor.completion_tokens for actor in choices)
    out.update(completion_tokens=completion, total_tokens=out["prompt_tokens"] + completion)
    if "completion_tokens_details" in out:  # reasoning rows: every choice's reasoning tokens
        out["completion_tokens_details"] = {"reasoning_tokens": sum(actor.reasoning_tokens for actor in choices)}
    if "speculation" in out:  # the server verifies drafts: every choice's
        out["speculation"] = {
            "drafted": sum(actor.drafted_tokens for actor in choices),
            "accepted": sum(actor.accepted_tokens for actor in choices),
        }
        if out["lane"] and not out["lane"].endswith("+spec") and out["speculation"]["drafted"]:
            out["lane"] += "+spec"
    return out


async def collect_choices(choices: Choices) -> list[Completion]:
    """Run every choice to its end, in turn; closes them. A failure → ApiError with its status."""
    completions = [Completion() for _ in choices]
    live = list(range(len(choices)))
    try:
        while live:
            for index in list(live):
                events = await choices[index].next_events()
                if events is None:
                    live.remove(index)
                else:
                    add_events(completions[index], events)
    except GenerationFailed as exc:
        raise ApiError(exc.status, str(exc)) from exc
    finally:
        for actor in choices:
            actor.close()
    return [finish(done, actor) for done, actor in zip(completions, choices)]


def logprobs_block(
    actor: RequestActor[Event], generation: Generation, tokenizer: ChatTokenizer
) -> dict[str, Any] | None:
    """Chat's `choices[0].logprobs`: every captured token of the choice (`logprobs_entries`), or
    None."""
    if not generation.captures_logprobs or not actor.token_logprobs:
        return None
    return {"content": logprobs_entries(actor.token_logprobs, generation, tokenizer)}


def logprobs_entries(
    outs: Sequence[TokenOut], generation: Generation, tokenizer: ChatTokenizer
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for these tokens, in mlx_lm.server's shape (NOT OpenAI's).

    `top_logprobs > 0`: each entry is the top candidate merged with its top-k list (sorted
    descending, so the entry is the argmax), `token` the raw vocabulary piece; else
    `{id, logprob}` of the sampled token. One entry per generated token, EOS included.
    """
    if generation.sampling.top_logprobs > 0:
        content = []
        for out in outs:
            top = [
                {"id": t.token, "token": _piece(tokenizer, t.token), "logprob": json_float(t.logprob)}
                for t in out.top_logprobs
            ]
            content.append({**top[0], "top_logprobs": top} if top else {})
        return content
    return [{"id": out.token, "logprob": json_float(out.logprob)} for out in outs]


def _piece(tokenizer: ChatTokenizer, token_id: int) -> str:
    try:
        return tokenizer.id_to_token(token_id)
    except Exception:  # a padded-vocab id beyond the tokenizer, or a tokenizer double
        return ""


def json_float(value: float | None) -> float | None:
    # JSON has no NaN / -Infinity; a masked (-inf) candidate reports OpenAI's floor instead.
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else MASKED_LOGPROB


class TokenNames:
    """Token ids → their text (decoded one by one), and the names a legacy logprobs block gives
    them: the text, or vLLM's "token_id:<id>" with `as_ids` (`return_tokens_as_token_ids`)."""

    def __init__(self, tokenizer: ChatTokenizer, *, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        try:
            return self.tokenizer.decode([token_id])
        except Exception:  # a padded-vocab id beyond the tokenizer, or a tokenizer double
            return ""

    def name(self, token_id: int, text: str | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.text(token_id) if text is None else text


def legacy_logprobs(outs: Sequence[TokenOut], names: TokenNames, *, offset: int = 0) -> tuple[dict[str, Any], int]:
    """The legacy completions API's `logprobs` for these tokens, and the text offset after them.

    `tokens`: each token (its text, or its id: `TokenNames`); `token_logprobs`: the sampled
    token's; `top_logprobs`: per token `{token: logprob}` of the requested alternatives and the
    sampled token (OpenAI: up to logprobs + 1 entries); `text_offset`: where each token's text
    starts, counted from `offset`.
    """
    block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for out in outs:
        text = names.text(out.token)
        token = names.name(out.token, text)
        top: dict[str, float | None] = {}
        for alternative in out.top_logprobs:  # most likely first
            top.setdefault(names.name(alternative.token), json_float(alternative.logprob))
        top.setdefault(token, json_float(out.logprob))
        block["tokens"].append(token)
        block["token_logprobs"].append(json_float(out.logprob))
        block["top_logprobs"].append(top)
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def _failure_frames(exc: BaseException) -> bytes:
    """The error frame (OpenAI's error shape), then [DONE]: nothing else follows a failure."""
    client = isinstance(exc, GenerationFailed) and exc.status < 500  # the request's own constraint failed
    error = data_frame(error_body(str(exc), type="invalid_request_error" if client else "server_error"))
    return error + DONE_FRAME


def _chat_delta(event: Event) -> dict[str, Any] | None:
    """A chunk's delta; None for nothing to send. A call streams as vLLM's and OpenAI's do: a
    header (index, id, type, name, arguments "") then `function.arguments` pieces; the closing
    ToolCallsEvent repeats calls every one of which streamed, so it sends nothing."""
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]}
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
    if isinstance(event, ToolCallsEvent):
        return None
    return {event.kind: event.text}  # "content" | "reasoning"


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent pieces of one kind of text, or of one call's arguments, as one (the tokens of a
    turn then ride with their text in one chunk)."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta) and last.kind == event.kind:
            out[-1] = TextDelta(event.kind, last.text + event.text)
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            out[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


async def chat_stream(
    started: StartedGeneration, meta: ResponseMeta, tokenizer: ChatTokenizer, *, include_usage: bool = False
) -> AsyncIterator[bytes]:
    """With logprobs, every chunk has `logprobs`: the entries (`logprobs_entries`) of the tokens
    generated since the previous chunk that carried any, or null. A turn's tokens ride on its
    first chunk (with its events merged: one chunk per kind of text in the turn); tokens whose
    text is held back (a partial stop string or tag, tool-call markup) ride on the next chunk;
    the finishing chunk carries the rest, EOS included. Concatenated, they are the whole
    answer's `logprobs.content`, reasoning and call tokens included."""
    choices = started.choices
    generation = started.generation
    logprobs = generation.captures_logprobs
    sent = [0] * len(choices)  # per choice: the captured tokens already sent

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, *, tokens: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": delta}
        if logprobs:
            outs = choices[index].token_logprobs[sent[index] :] if tokens else []
            sent[index] += len(outs)
            choice["logprobs"] = {"content": logprobs_entries(outs, generation, tokenizer)} if outs else None
        choice["finish_reason"] = finish
        return data_frame(meta.envelope("chat.completion.chunk", [choice], usage_key=include_usage))

    try:
        yield b"".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(len(choices)))
        live = list(range(len(choices)))
        while live:
            for index in list(live):
                events = await next_events_or_timeout(choices[index], KEEPALIVE_INTERVAL_S)
                while events is TIMED_OUT:  # a long prefill: keep the proxies' idle timers off
                    yield KEEPALIVE_FRAME
                    events = await next_events_or_timeout(choices[index], KEEPALIVE_INTERVAL_S)
                if events is None:
                    live.remove(index)
                    yield chunk(index, {}, choices[index].finish_reason, tokens=True)
                    continue
                if logprobs:
                    events = _merged(events)
                deltas = [delta for event in events if (delta := _chat_delta(event)) is not None]
                if deltas:  # one write for every token that was waiting: one chunk per delta
                    yield b"".join([chunk(index, delta, tokens=i == 0) for i, delta in enumerate(deltas)])
        if include_usage:
            yield data_frame(meta.envelope("chat.completion.chunk", [], usage(choices), usage_key=True))
        yield DONE_FRAME
    except Exception as exc:  # after the headers an exception would only truncate the body
        if not isinstance(exc, GenerationFailed):
            log.exception("chat stream failed")
        yield _failure_frames(exc)
    finally:
        for actor in choices:
            actor.close()


async def chat_whole(started: StartedGeneration, meta: ResponseMeta, tokenizer: ChatTokenizer) -> dict[str, Any]:
    choices = []
    for index, (done, actor) in enumerate(zip(await collect_choices(started.choices), started.choices)):
        message: dict[str, Any] = {"role": "assistant", "content": done.content or (None if done.calls else "")}
        if done.reasoning:
            message["reasoning"] = done.reasoning
        if done.calls:
            message["tool_calls"] = [_tool_call(call) for call in done.calls]
        choice: dict[str, Any] = {"index": index, "message": message}
        block = logprobs_block(actor, started.generation, tokenizer)
        if block is not None:
            choice["logprobs"] = block
        choice["finish_reason"] = done.finish_reason
        choices.append(choice)
    return meta.envelope("chat.completion", choices, usage(started.choices), usage_key=True)


async def text_stream(
    started: StartedGeneration,
    meta: ResponseMeta,
    names: TokenNames,
    *,
    include_usage: bool = False,
    echo: str = "",
    scored: ScoredPrompt | None = None,
) -> AsyncIterator[bytes]:
    """With `echo`, each choice's first chunk is that prompt text (with `scored`, its tokens'
    logprobs: api/openai/prompt_logprobs.py). With logprobs, a chunk carries the tokens that
    arrived since the last one (their text may still be held back by the stop matcher: it
    follows in a later chunk); the finishing chunk carries the rest, EOS included."""
    choices = started.choices
    logprobs = started.generation.captures_logprobs
    sent = [0] * len(choices)  # per choice: the captured tokens already sent
    prompt_block, prompt_end = prompt_block_of(scored, names)
    offsets = [prompt_end] * len(choices)

    def chunk(index: int, text: str, finish: str | None = None, *, tokens: bool = True) -> bytes:
        block = None
        if logprobs and tokens:
            outs = choices[index].token_logprobs[sent[index] :]
            sent[index] += len(outs)
            block, offsets[index] = legacy_logprobs(outs, names, offset=offsets[index])
        elif not tokens:  # the echo chunk: the prompt's scores, when asked
            block = prompt_block
        choice = {"index": index, "text": text, "logprobs": block, "finish_reason": finish}
        return data_frame(meta.envelope("text_completion", [choice], usage_key=include_usage))

    try:
        if echo:
            yield b"".join(chunk(i, echo, tokens=False) for i in range(len(choices)))
        live = list(range(len(choices)))
        while live:
            for index in list(live):
                events = await next_events_or_timeout(choices[index], KEEPALIVE_INTERVAL_S)
                while events is TIMED_OUT:
                    yield KEEPALIVE_FRAME
                    events = await next_events_or_timeout(choices[index], KEEPALIVE_INTERVAL_S)
                if events is None:
                    live.remove(index)
                    yield chunk(index, "", choices[index].finish_reason)
                    continue
                texts = [e.text for e in events if isinstance(e, TextDelta) and e.text]
                if logprobs and texts:  # one chunk, so its text and its tokens go together
                    yield chunk(index, "".join(texts))
                elif texts:  # one chunk per text event (about one per token), all in one write
                    yield b"".join([chunk(index, text) for text in texts])
        if include_usage:
            yield data_frame(meta.envelope("text_completion", [], usage(choices), usage_key=True))
        yield DONE_FRAME
    except Exception as exc:
        if not isinstance(exc, GenerationFailed):
            log.exception("completion stream failed")
        yield _failure_frames(exc)
    finally:
        for actor in choices:
            actor.close()


async def text_whole(
    started: StartedGeneration,
    meta: ResponseMeta,
    names: TokenNames,
    *,
    echo: str = "",
    scored: ScoredPrompt | None = None,
) -> dict[str, Any]:
    """`echo`: the prompt text each choice's text starts with; `scored`: its tokens' logprobs,
    which the logprobs block starts with (api/openai/prompt_logprobs.py)."""
    dones = await collect_choices(started.choices)  # no think split or tools here: all text is content
    logprobs = started.generation.captures_logprobs
    prompt_block, prompt_end = prompt_block_of(scored, names)
    choices = [
        {
            "index": index,
            "text": echo + done.content,
            "logprobs": _joined(prompt_block, legacy_logprobs(actor.token_logprobs, names, offset=prompt_end)[0])
            if logprobs
            else None,
            "finish_reason": done.finish_reason,
        }
        for index, (done, actor) in enumerate(zip(dones, started.choices))
    ]
    return meta.envelope("text_completion", choices, usage(started.choices), usage_key=True)


# -- prompt logprobs (api/openai/prompt_logprobs.py) ---------------------------------------------


def prompt_block_of(scored: ScoredPrompt | None, names: TokenNames) -> tuple[dict[str, list[Any]] | None, int]:
    """The legacy logprobs block of a scored prompt's tokens (the first with null logprob and
    alternatives: nothing precedes it), and the text offset after them; (None, 0) without one."""
    if scored is None:
        return None, 0
    block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, (logprob, alternatives) in zip(scored.tokens, scored.scores):
        text = names.text(token)
        name = names.name(token, text)
        top: dict[str, float | None] | None = None
        if logprob is not None:
            top = {}
            for alternative in alternatives:  # most likely first
                top.setdefault(names.name(alternative.token), json_float(alternative.logprob))
            top.setdefault(name, json_float(logprob))
        block["tokens"].append(name)
        block["token_logprobs"].append(json_float(logprob))
        block["top_logprobs"].append(top)
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def _joined(prompt: dict[str, list[Any]] | None, generated: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The prompt's block, then the generated tokens'."""
    return generated if prompt is None else {key: prompt[key] + generated[key] for key in prompt}


def _scored_choices(
    scored: ScoredPrompt, names: TokenNames, echo: str, n: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    block = prompt_block_of(scored, names)[0]
    choices = [{"index": i, "text": echo, "logprobs": block, "finish_reason": "length"} for i in range(n)]
    tokens = len(scored.tokens)
    usage = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    return choices, {**usage, "prompt_tokens_details": {"cached_tokens": 0}}


def scored_whole(scored: ScoredPrompt, meta: ResponseMeta, names: TokenNames, *, echo: str, n: int) -> dict[str, Any]:
    """`max_tokens: 0` with echo and logprobs: each choice is the prompt and its scores."""
    choices, usage_ = _scored_choices(scored, names, echo, n)
    return meta.envelope("text_completion", choices, usage_, usage_key=True)


async def scored_stream(
    scored: ScoredPrompt, meta: ResponseMeta, names: TokenNames, *, echo: str, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """`scored_whole` streamed: one chunk per choice, then the usage chunk (when asked), [DONE]."""
    choices, usage_ = _scored_choices(scored, names, echo, n)
    for choice in choices:
        yield data_frame(meta.envelope("text_completion", [choice], usage_key=include_usage))
    if include_usage:
        yield data_frame(meta.envelope("text_completion", [], usage_, usage_key=True))
    yield DONE_FRAME
