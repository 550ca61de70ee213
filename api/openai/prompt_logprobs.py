"""Prompt logprobs on /v1/completions: `echo: true` with `logprobs: N`.

The answer's legacy logprobs block then starts with the prompt's tokens, each with its logprob
given the tokens before it and its N likeliest alternatives, as OpenAI's legacy API answered
them; the first token has none (`token_logprobs[0]` and `top_logprobs[0]` are null). The
generated tokens follow, their `text_offset`s counted on from the prompt's
(api/openai/encode.py `prompt_block_of`). `max_tokens: 0` scores the prompt without generating
(what evaluation harnesses send): the answer is the prompt alone, `finish_reason: "length"`.

The scores come from a forward of the prompt that the worker runs as a job of its own
(`GpuWorker.score`, model/engine/scoring.py); a worker that cannot score answers 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from actors.gpu_worker import WorkerDied
from actors.handles import ScoresPrompts, ServerHandles
from api.errors import ApiError, bad_request

if TYPE_CHECKING:
    from model.engine.scoring import PromptScore


@attrs.frozen
class ScoredPrompt:
    """A prompt's tokens and their scores (`PromptScore`s, one per token)."""

    tokens: tuple[int, ...]
    scores: tuple[PromptScore, ...]


async def score_prompt(
    handles: ServerHandles, tokens: Sequence[int], *, top: int, adapters: tuple[str, ...]
) -> ScoredPrompt:
    """The prompt's scores from the worker. Raises ApiError (400) when it cannot score."""
    worker = handles.worker
    if not isinstance(worker, ScoresPrompts):
        raise bad_request("prompt logprobs (echo with logprobs) are not available on this server", param="echo")
    try:
        scores = await worker.score(list(tokens), top=top, adapters=adapters)
    except ValueError as exc:
        raise bad_request(f"prompt logprobs: {exc}", param="echo") from None
    except WorkerDied:
        raise ApiError(503, "the model worker is not running", code="worker_unavailable") from None
    return ScoredPrompt(tuple(tokens), tuple(scores))
