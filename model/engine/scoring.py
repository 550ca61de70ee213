"""Prompt logprobs: what the model gives each prompt token after the tokens before it.

`/v1/completions` with `echo` and `logprobs` answers the prompt's tokens with their logprobs, as
OpenAI's legacy API did (the first token has none: nothing precedes it). `prompt_logprobs` runs
the prompt through fresh caches (nothing to or from the prompt cache or the decode batch), a
prefill chunk per forward, and projects the LM head a slice of positions at a time: a whole
chunk's [L, vocab] logits would be gigabytes on a large vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx

from model.engine.rows import TopLogprob
from model.nn.language_model import LanguageModel

if TYPE_CHECKING:
    from model.engine.engine import Engine

# Logit floats one projection may hold at once (an [n, vocab] slice): 64 Mi floats.
LOGITS_SLICE_FLOATS = 1 << 26

# One prompt token's score: its logprob (None for the first token) and the likeliest tokens there.
PromptScore = tuple[float | None, tuple[TopLogprob, ...]]


def engine_scores(
    engine: Engine, tokens: Sequence[int], *, top: int, adapters: tuple[str, ...], chunk: int
) -> list[PromptScore]:
    """`prompt_logprobs` on the engine's model with `adapters` stacked (ValueError: one is not
    mounted), between its row calls: the batch's rows are untouched."""
    selection = engine.adapters.open(adapters)
    try:
        engine.adapters.select([selection])
        return prompt_logprobs(engine.model, tokens, top=top, chunk=chunk)
    finally:
        engine.adapters.close(adapters)


def prompt_logprobs(model: LanguageModel, tokens: Sequence[int], *, top: int = 0, chunk: int) -> list[PromptScore]:
    """Per prompt token: (its logprob given the tokens before it, the `top` likeliest tokens at its
    position, most likely first); (None, ()) for the first token."""
    if not tokens:
        raise ValueError("an empty prompt has no tokens to score")
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    caches = model.make_caches()
    scored: list[PromptScore] = [(None, ())]
    n = len(tokens)
    vocab_rows = 0
    for start in range(0, n - 1, chunk):  # position i's logits score token i + 1
        end = min(start + chunk, n - 1)
        hidden = model(ids[:, start:end], caches)
        mx.eval(hidden, [c.state for c in caches])
        vocab_rows = vocab_rows or max(1, LOGITS_SLICE_FLOATS // _vocab(model, hidden))
        for lo in range(0, end - start, vocab_rows):
            hi = min(lo + vocab_rows, end - start)
            logits = model.logits(hidden[0, lo:hi]).astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = ids[0, start + lo + 1 : start + hi + 1]
            chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
            if top > 0:
                k = min(top, logprobs.shape[-1])
                top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
                top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
                mx.eval(chosen, top_ids, top_values)
                id_rows = cast(list[list[int]], top_ids.tolist())
                value_rows = cast(list[list[float]], top_values.tolist())
            else:
                mx.eval(chosen)
                id_rows, value_rows = [[] for _ in range(hi - lo)], [[] for _ in range(hi - lo)]
            for lp, row_ids, row_values in zip(cast(list[float], chosen.tolist()), id_rows, value_rows):
                pairs = sorted(zip(row_ids, row_values), key=lambda p: -p[1])
                scored.append((lp, tuple(TopLogprob(i, v) for i, v in pairs)))
    return scored


def _vocab(model: LanguageModel, hidden: mx.array) -> int:
    """The LM head's width, read off one position's projection (families do not all expose it)."""
    return int(model.logits(hidden[0, :1]).shape[-1])
