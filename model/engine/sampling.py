"""Per-row logits processors and samplers (mlx-lm semantics), with seed-keyed randomness.

Order per token, as in mlx-lm's generate_step: logits processors (logit_bias, repetition,
presence, frequency penalties over the row's recent history) → logprobs = logits − logsumexp
(what logprobs report) → sampler filters (top_p, min_p, xtc, top_k) → categorical at 1/T, or
argmax when T = 0.

Randomness never touches MLX's global RNG: each row draws from `key(seed, step)`, so a seeded row
samples the same tokens whatever else shares the batch.

Structured output: a row whose params carry a `Constraint` owns a `RowGrammar` (model/text/grammar.py);
`process` applies its allowed-token mask after the logits processors, so the logprobs and every
sampler filter see only what the grammar allows. The engine reports each token fed back into the
model through `observe`, before the row's next `process`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np

from model.engine.params import SamplingParams

if TYPE_CHECKING:
    from model.text.grammar import GrammarCompiler, RowGrammar

Processor = Callable[[mx.array, mx.array], mx.array]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def step_key(seed: int, step: int) -> mx.array:
    # splitmix-style scramble: nearby (seed, step) pairs give unrelated keys.
    z = (seed + (step + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mx.random.key(z ^ (z >> 31))


def make_processors(p: SamplingParams) -> tuple[list[Processor], int]:
    """Processors and the history length they read (0 = none needs history)."""
    processors: list[Processor] = []
    context = 0
    if p.logit_bias:
        indices = mx.array([i for i, _ in p.logit_bias])
        values = mx.array([v for _, v in p.logit_bias])
        processors.append(lambda _, logits: logits.at[:, indices].add(values))
    if p.repetition_penalty not in (0.0, 1.0):
        processors.append(_repetition(p.repetition_penalty, p.repetition_context_size))
        context = max(context, p.repetition_context_size)
    if p.presence_penalty:
        processors.append(_presence(p.presence_penalty, p.presence_context_size))
        context = max(context, p.presence_context_size)
    if p.frequency_penalty:
        processors.append(_frequency(p.frequency_penalty, p.frequency_context_size))
        context = max(context, p.frequency_context_size)
    return processors, context


def _repetition(penalty: float, context_size: int) -> Processor:
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size:
            tokens = tokens[-context_size:]
            selected = logits[:, tokens]
            selected = mx.where(selected < 0, selected * penalty, selected / penalty)
            logits[:, tokens] = selected
        return logits

    return apply


def _presence(penalty: float, context_size: int) -> Processor:
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size:
            logits[:, tokens[-context_size:]] -= penalty
        return logits

    return apply


def _frequency(penalty: float, context_size: int) -> Processor:
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size:
            # .at[].subtract accumulates over repeats: penalty × occurrences.
            logits = logits.at[:, tokens[-context_size:]].subtract(penalty)
        return logits

    return apply


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    sorted_lp = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_lp.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + sorted_probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_lp, dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def apply_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + math.log(min_p), -float("inf"), logprobs)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    if not 0 < top_k < logprobs.shape[-1]:
        return logprobs
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def apply_xtc(
    logits: mx.array, probability: float, threshold: float, protected: mx.array | None, key: mx.array
) -> mx.array:
    """Exclude Top Choices: drop every token above `threshold` except the least likely of them.

    `protected` (EOS and newline ids) are never removed, so XTC cannot make a row run forever.
    """
    probs = mx.softmax(logits, -1)
    mask = probs > mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if protected is not None:
        mask[..., protected] = False
    apply = mx.random.uniform(0, 1, key=key) <= probability
    return mx.where(apply, mx.where(mask, -mx.inf, logits), logits)


def apply_token_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """-inf wherever `allowed` ([V] bools, V = logits' last axis) is False."""
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), logits.dtype))


class RowSampler:
    """Everything one row needs to turn its [1, V] logits into the next token."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        protected_ids: Iterable[int] = (),
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.params = params
        self.processors, self.history_size = make_processors(params)
        protected = sorted(set(protected_ids))
        self._protected = mx.array(protected) if protected else None
        self.grammar: RowGrammar | None = None
        self._greedy = params.is_greedy
        if params.constraint is not None:
            if grammars is not None:
                # Raises GrammarError: the row fails rather than run unconstrained (the API
                # rejects a constraint that does not compile, so this is a last resort).
                self.grammar = grammars.matcher(params.constraint)
            else:  # no grammar engine: served unconstrained, as the API told the client
                self._greedy = attrs.evolve(params, constraint=None).is_greedy

    @property
    def greedy(self) -> bool:
        return self._greedy

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    def observe(self, index: int, token: int) -> None:
        """The row's token at `index` (0 = first generated) is known; idempotent per index."""
        if self.grammar is not None:
            self.grammar.observe(index, token)

    def process(self, history: mx.array | None, logits: mx.array) -> mx.array:
        for processor in self.processors:
            logits = processor(history if history is not None else mx.array([], mx.int32), logits)
        if self.grammar is not None:
            logits = apply_token_mask(logits, self.grammar.mask(logits.shape[-1]))
        return logits

    def sample(self, logprobs: mx.array, step: int) -> mx.array:
        p = self.params
        if p.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        key = step_key(p.seed, step)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.xtc_probability > 0.0:
            xtc_key, key = mx.random.split(key)
            logprobs = apply_xtc(logprobs, p.xtc_probability, p.xtc_threshold, self._protected, xtc_key)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        scaled = logprobs * (1.0 / p.temperature)
        sampled = mx.random.categorical(scaled, key=key)
        # A temperature so small that 1/T overflows the dtype leaves no finite weight (every token
        # -inf, or NaN): the limit of sampling there is the argmax, never an arbitrary token.
        return mx.where(mx.isfinite(mx.max(scaled, axis=-1)), sampled, mx.argmax(logprobs, axis=-1))


def observe_batch(samplers: list[RowSampler], indices: list[int], tokens: list[int]) -> None:
    """Each row's token at its index is known (see RowSampler.observe); then the constrained rows'
    next masks are filled together, in parallel, ready for their `process` calls."""
    for sampler, index, token in zip(samplers, indices, tokens):
        sampler.observe(index, token)
    grammars = [s.grammar for s in samplers if s.grammar is not None]
    if len(grammars) > 1:
        from model.text.grammar import fill_masks

        fill_masks(grammars)


def logprobs_of(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
