"""One speculative decode step for a row: draft K tokens, verify them in one target forward,
keep the longest prefix the target's own sampling produces.

Greedy rows accept a draft token while it equals the target's argmax there, so the output is
exactly plain decoding's. Sampled rows use the standard speculative-sampling rule for a
deterministic drafter (both drafters propose their single likeliest continuation, so the draft
distribution is one-hot): draft token d at position i is kept with probability p_i(d), and the
first rejected one is replaced by a sample from p_i with d removed; after K kept tokens a bonus
token is sampled from p_K. The output is distributed as the target's, and each draw is keyed by
(seed, token index), so a seeded row is reproducible.

The target's caches take K + 1 positions (the row's last token and the drafts) and are trimmed
back to what was kept; a draft model keeps its own per-row caches (`DraftState`), re-prefilled
from the row's tokens on the row's first step (the target's prompt-cache hit does not cover them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, cast

import attrs
import mlx.core as mx

from model.decoding import Row, record
from model.kv_cache import KVCache, make_caches
from model.language_model import LanguageModel
from model.rows import TokenOut
from model.sampling import apply_min_p, apply_top_k, apply_top_p, logprobs_of, step_key
from model.speculation import Speculation, ngram_drafts

DRAFT_PREFILL_CHUNK = 2048


@attrs.define(eq=False)
class DraftState:
    """A draft model's caches for one row: `covered` known tokens, then `pending` drafts fed."""

    caches: list[KVCache]
    covered: int = 0
    pending: int = 0


class Speculator:
    def __init__(self, speculation: Speculation) -> None:
        self.settings = speculation
        self.k = speculation.num_draft_tokens

    def applies(self, row: Row) -> bool:
        """Rows whose next-token distribution depends only on the target's logits: no grammar
        (its mask needs each token before the next), no penalty history, no XTC draw."""
        s = row.sampler
        return not s.constrained and not s.history_size and s.params.xtc_probability <= 0.0

    def propose(self, row: Row) -> list[int]:
        known = row.prompt + row.tokens
        room = row.max_tokens - row.generated - 1  # tokens the row may still take after this one
        k = min(self.k, max(0, room))
        if k <= 0:
            return []
        s = self.settings
        if s.kind == "ngram":
            return ngram_drafts(known, k, s.ngram_min, s.ngram_max)
        assert s.draft_model is not None
        return _draft(s.draft_model, row, known, k)

    def verified(self, row: Row, drafts: Sequence[int], kept: int) -> None:
        """The target kept `kept` of `drafts`: the draft model's caches keep what still matches."""
        state = _draft_state(row)
        if state is None:
            return
        fed = state.pending  # drafts fed to the draft model (all but the last)
        valid = min(kept, fed)
        for c in state.caches:
            c.trim(fed - valid)
        state.covered += valid
        state.pending = 0


def _draft_state(row: Row) -> DraftState | None:
    return cast(DraftState | None, row.draft)


def _draft(model: LanguageModel, row: Row, known: list[int], k: int) -> list[int]:
    state = _draft_state(row)
    if state is None:
        state = row.draft = DraftState(make_caches(len(model.layers)))
    todo = known[state.covered :]
    for start in range(0, len(todo) - 1, DRAFT_PREFILL_CHUNK):  # catch up (a whole prompt at first)
        model(mx.array(todo[start : min(start + DRAFT_PREFILL_CHUNK, len(todo) - 1)])[None], state.caches)
        mx.eval([c.state for c in state.caches])
    token = mx.array(todo[-1:])
    drafts = []
    for _ in range(k):
        token = mx.argmax(model.logits(model(token[None], state.caches)[:, -1, :]), axis=-1)
        drafts.append(token)
    state.covered = len(known)  # each forward fed its input: known tokens, then drafts[:-1]
    state.pending = k - 1
    return cast(list[int], mx.concatenate(drafts).tolist())


def _distribution(row: Row, logprobs: mx.array) -> mx.array:
    """Log-weights of what `RowSampler.sample` draws from (temperature > 0), over the last axis."""
    p = row.sampler.params
    if 0 < p.top_p < 1.0:
        logprobs = apply_top_p(logprobs, p.top_p)
    if p.min_p != 0.0:
        logprobs = apply_min_p(logprobs, p.min_p)
    if p.top_k > 0:
        logprobs = apply_top_k(logprobs, p.top_k)
    return logprobs_of(logprobs * (1.0 / p.temperature))


def speculative_step(
    model: LanguageModel, caches: list[Any], row: Row, speculator: Speculator, eos: Collection[int]
) -> list[TokenOut] | None:
    """Draft, verify and keep for the batch's only row (its caches are `caches`); None when the
    drafter has nothing to propose (the caller decodes one token as usual)."""
    drafts = speculator.propose(row)
    if not drafts:
        return None
    fed = [row.last_token, *drafts]
    logits = model.logits(model(mx.array(fed)[None], caches)[0])  # [K + 1, vocab]
    logprobs = logprobs_of(logits)
    n = len(drafts)
    if row.sampler.greedy:
        chosen = mx.argmax(logprobs, axis=-1)
        chosen_list = cast(list[int], chosen.tolist())
        kept = next((i for i in range(n) if drafts[i] != chosen_list[i]), n)
        emitted = chosen_list[: kept + 1]
    else:
        emitted, kept = _sample_verify(row, logprobs, drafts)
    for c in caches:
        c.trim(n - kept)  # the rejected drafts' positions
    outs = _record_all(row, logprobs, emitted, eos)
    outs[0] = attrs.evolve(outs[0], drafted=n, accepted=kept)
    row.sampled += len(emitted)
    row.kv_length += kept + 1
    speculator.verified(row, drafts, kept)
    return outs


def _sample_verify(row: Row, logprobs: mx.array, drafts: list[int]) -> tuple[list[int], int]:
    n = len(drafts)
    weights = _distribution(row, logprobs)  # [n + 1, vocab] log-probabilities
    ids = mx.array(drafts)
    p_draft = mx.exp(mx.take_along_axis(weights[:n], ids[:, None], axis=-1)[:, 0])
    keys = [mx.random.split(step_key(row.sampler.params.seed, row.sampled + i)) for i in range(n + 1)]
    uniforms = mx.stack([mx.random.uniform(key=keys[i][0]) for i in range(n)])
    without = mx.put_along_axis(weights[:n], ids[:, None], mx.array(-mx.inf, weights.dtype), axis=-1)
    resampled = mx.stack([mx.random.categorical(without[i], key=keys[i][1]) for i in range(n)])
    bonus = mx.random.categorical(weights[n], key=keys[n][1])
    accept = cast(list[bool], (uniforms < p_draft).tolist())
    kept = next((i for i in range(n) if not accept[i]), n)
    last = cast(int, bonus.item()) if kept == n else cast(int, resampled[kept].item())
    return [*drafts[:kept], last], kept


def _record_all(row: Row, logprobs: mx.array, emitted: list[int], eos: Collection[int]) -> list[TokenOut]:
    params = row.sampler.params
    outs = []
    for i, token in enumerate(emitted):
        lp = top = None
        if params.logprobs or params.top_logprobs:
            lp = logprobs[i, token]
        if params.top_logprobs > 0:
            k = min(params.top_logprobs, logprobs.shape[-1])
            ids = mx.argpartition(-logprobs[i], kth=k - 1)[:k]
            top = (ids, logprobs[i][ids])
        outs.append(record(row, token, lp, top, eos))
        if row.finished:
            break
    return outs
