"""One speculative decode step for the batch: each row drafts up to K tokens, one target forward
verifies them all, and each row keeps the longest prefix its own sampling produces.

At every drafted position the row's token is sampled exactly as plain decoding samples it (the
same processed logits, the same (seed, token index) key, a token its reasoning forces put in
its place: model/engine/reasoning.py), and a draft token is kept while it equals that sample.
Both drafters propose their single likeliest continuation (a one-hot draft distribution), for
which this is the standard speculative-sampling rule: d is kept with probability p(d), and a
rejected d is replaced by a sample of p without d. So greedy and seeded sampled output is plain
decoding's token for token, whatever steps speculate.

Rows with fewer drafts are padded to the batch's K. A lone row's caches are trimmed back to what
was kept; a merged batch's rejected slots become holes (`BatchKVCache.reject`). A draft model
keeps its own per-row caches (`DraftState`), re-prefilled from the row's tokens on the row's
first step (the target's prompt-cache hit does not cover them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import attrs
import mlx.core as mx
import numpy as np

from model.engine.decoding import Row, read, record
from model.engine.rows import TokenOut
from model.engine.sampling import logprobs_of
from model.engine.speculation import SpecPolicy, Speculation, ngram_drafts
from model.kv.cache import SoloCache
from model.lora import mount as lora
from model.nn.language_model import LanguageModel

DRAFT_PREFILL_CHUNK = 2048


@attrs.define(eq=False)
class DraftState:
    """A draft model's caches for one row: `covered` known tokens, then `pending` drafts fed."""

    caches: list[SoloCache]
    covered: int = 0
    pending: int = 0


class Speculator:
    def __init__(self, speculation: Speculation) -> None:
        self.settings = speculation
        self.k = speculation.num_draft_tokens
        self.policy = SpecPolicy()
        self.caught_up = 0  # tokens the draft model caught up on in this step

    def applies(self, row: Row) -> bool:
        """Rows whose token at each position depends only on the target's logits there: no
        grammar (its mask needs each token before the next) and no penalty history."""
        return not row.sampler.constrained and not row.sampler.history_size

    def step(self, engine: Any, plain: Callable[[], list[TokenOut]]) -> list[TokenOut]:
        """The engine's decode step: a verification when the policy expects more tokens per
        second from it than from `plain` (the pipelined one-token step), else `plain`."""
        rows = engine._batch
        width = len(rows)
        if not (self.settings.always or self.policy.speculate(width)) or not all(self.applies(r) for r in rows):
            started = time.perf_counter()
            done = plain()
            self.policy.plain_done(width, time.perf_counter() - started)
            return done
        if engine._inflight is not None:  # a pipelined step is out: read it first
            current, engine._inflight = engine._inflight, None
            return read(current, engine.eos)
        started, self.caught_up = time.perf_counter(), 0
        outs = speculative_step(engine.model, engine._caches, rows, self, engine.eos, engine.adapters.select)
        if outs is None:
            if not self.settings.always:
                self.policy.nothing_to_draft(width)
            return plain()
        if self.caught_up <= self.k + 1:  # (a draft model's first prefill of a row is not a step's cost)
            self.policy.spec_done(width, time.perf_counter() - started, len(outs))
        return outs

    def propose(self, row: Row) -> list[int]:
        room = row.max_tokens - row.generated - 1  # tokens the row may still take after this one
        k = min(self.k, max(0, room))
        if k <= 0:
            return []
        s = self.settings
        if s.kind == "ngram":
            return ngram_drafts(_token_array(row), k, s.ngram_min, s.ngram_max)
        assert s.draft_model is not None
        return _draft(self, s.draft_model, row, row.prompt + row.tokens, k)

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


class _Tokens:
    """A row's prompt and output as one growing int64 array (n-gram lookup reads it every step)."""

    def __init__(self, prompt: list[int]) -> None:
        self.array = np.zeros(max(64, 2 * len(prompt)), np.int64)
        self.array[: len(prompt)] = prompt
        self.size, self.prompt = len(prompt), len(prompt)


def _token_array(row: Row) -> np.ndarray:
    state = row.draft
    if not isinstance(state, _Tokens):
        state = row.draft = _Tokens(row.prompt)
    new = row.tokens[state.size - state.prompt :]
    if new:
        if state.size + len(new) > len(state.array):
            state.array = np.concatenate([state.array, np.zeros(len(state.array) + len(new), np.int64)])
        state.array[state.size : state.size + len(new)] = new
        state.size += len(new)
    return state.array[: state.size]


def _draft_state(row: Row) -> DraftState | None:
    return row.draft if isinstance(row.draft, DraftState) else None


def _draft(speculator: Speculator, model: LanguageModel, row: Row, known: list[int], k: int) -> list[int]:
    state = _draft_state(row)
    if state is None:
        state = row.draft = DraftState(list(model.make_caches()))
    todo = known[state.covered :]
    if lora.installed(model) is not None:  # (the target drafting for itself)
        lora.select(model, [row.lora])
    speculator.caught_up += len(todo)
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


def speculative_step(
    model: LanguageModel,
    caches: list[Any],
    rows: list[Row],
    speculator: Speculator,
    eos: Collection[int],
    select: Callable[[list[tuple[int, ...]]], None] = lambda _: None,  # the rows' LoRA adapters
) -> list[TokenOut] | None:
    """Draft, verify and keep for every row of the batch (its caches are `caches`: a lone row's
    own, or the merged batch's); None when no row has a draft (the caller decodes as usual)."""
    if not all(speculator.applies(r) for r in rows):
        return None
    drafts = [speculator.propose(r) for r in rows]
    k = max(len(d) for d in drafts)
    if k == 0:
        return None
    # Rows with fewer drafts are padded with repeats: their results are never read, and their
    # KV slots are dropped with the rejected ones.
    fed = [[r.last_token, *d, *[(d or [r.last_token])[-1]] * (k - len(d))] for r, d in zip(rows, drafts)]
    select([r.lora for r in rows])
    logprobs = logprobs_of(model.logits(model(mx.array(fed), caches)))  # [B, k + 1, vocab]
    # Each position's token is what plain decoding samples there (the same key, seed and step):
    # a draft is kept while it equals it. For a one-hot drafter that is the speculative-sampling
    # rule, and the output is plain decoding's, sampled rows included.
    if all(r.sampler.greedy for r in rows):
        samples = cast(list[list[int]], mx.argmax(logprobs, axis=-1).tolist())
    else:
        per_row = [
            mx.concatenate([r.sampler.sample(logprobs[b, i][None], r.sampled + i) for i in range(len(d) + 1)])
            for b, (r, d) in enumerate(zip(rows, drafts))
        ]
        samples = [cast(list[int], t.tolist()) for t in per_row]
    for b, row in enumerate(rows):  # a row whose reasoning ends here emits the forced tokens instead
        think = row.sampler.think
        if think is not None and not think.done:
            samples[b] = think.forced_along(samples[b])
    kept = [next((i for i in range(len(d)) if d[i] != s[i]), len(d)) for d, s in zip(drafts, samples)]
    for c in caches:
        c.reject([n + 1 for n in kept], k + 1)
    outs: list[TokenOut] = []
    for b, (row, d, n) in enumerate(zip(rows, drafts, kept)):
        emitted = samples[b][: n + 1]
        row_outs = _record_all(row, logprobs[b], emitted, eos)
        row_outs[0] = attrs.evolve(row_outs[0], drafted=len(d), accepted=n)
        outs.extend(row_outs)
        row.sampled += len(emitted)
        row.kv_length += n + 1
        speculator.verified(row, d, n)
    return outs


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
