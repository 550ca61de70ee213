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

Reasoning: a row whose params carry a `ThinkControl` owns a `ThinkTracker`
(model/engine/reasoning.py). Once its reasoning budget is spent, `forced` names the token the
next position must be (the close marker, then the separator), which the engine emits instead of
the sample. With `constrain_after` the grammar waits for the end of the reasoning: the first
token may open the reasoning or begin the answer (the grammar's mask plus the open marker), and
the grammar consumes the tokens after the reasoning's separator, from its position 0; until then
the row may not end (its EOS ids are masked): the answer its constraint asks for is still due.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np

from model.engine.params import SamplingParams
from model.engine.reasoning import ThinkTracker
from model.engine.rows import RowSpec

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
        resumed: tuple[int, ...] = (),
    ) -> None:
        """`resumed`: the tokens a preempted row generated before it resumed (its RNG steps and
        reasoning go on from them; positions here count from the first token after them)."""
        self.params = params
        self.processors, self.history_size = make_processors(params)
        protected = sorted(set(protected_ids))
        self._protected = mx.array(protected) if protected else None
        self.grammar: RowGrammar | None = None
        self._greedy = params.is_greedy
        self.step_offset = len(resumed)  # a row's sample step minus this is a position here
        self.think = None if params.think is None else ThinkTracker.start(params.think, resumed)
        # Where the grammar's position 0 is among the row's (None: not yet, its reasoning runs).
        self._grammar_from: int | None = None if params.think and params.think.constrain_after else 0
        self._eos: mx.array | None = None  # a constrained row's EOS ids, masked while its reasoning runs
        if params.constraint is not None:
            if grammars is not None:
                # Raises GrammarError: the row fails rather than run unconstrained (the API
                # rejects a constraint that does not compile, so this is a last resort).
                self.grammar = grammars.matcher(params.constraint)
                self._eos = mx.array(grammars.eos_token_ids) if self._grammar_from is None else None
            else:  # no grammar engine: served unconstrained, as the API told the client
                self._greedy = attrs.evolve(params, constraint=None).is_greedy

    @classmethod
    def for_row(
        cls, spec: RowSpec, *, protected_ids: Iterable[int] = (), grammars: GrammarCompiler | None = None
    ) -> RowSampler:
        """The sampler of the row `spec` opens (a resumed row's: with the tokens it generated before)."""
        resumed = tuple(spec.prompt[len(spec.prompt) - spec.resumed :]) if spec.resumed else ()
        return cls(spec.sampling, protected_ids=protected_ids, grammars=grammars, resumed=resumed)

    @property
    def greedy(self) -> bool:
        return self._greedy

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def active_grammar(self) -> RowGrammar | None:
        """The grammar when it masks the next position (not while the reasoning before it runs)."""
        return self.grammar if self._grammar_from is not None else None

    def observe(self, index: int, token: int) -> None:
        """The row's token at `index` (0 = first generated) is known; idempotent per index."""
        think = self.think
        if think is not None and index >= think.seen:
            think.observe(index, token)
            if self._grammar_from is None and think.done:  # the reasoning and its separator are over
                self._grammar_from = index + 1
            elif self._grammar_from is None and index == 0 and think.phase == "before":
                think.finish()  # the first token did not open the reasoning: it begins the answer
                self._grammar_from = 0
        if self.grammar is not None and self._grammar_from is not None and index >= self._grammar_from:
            self.grammar.observe(index - self._grammar_from, token)

    def needs_previous(self, index: int) -> bool:
        """Whether sampling position `index` must wait for the token before it on the host: a
        grammar's mask follows it, and so may a forced token."""
        if self.grammar is not None:
            return True
        return self.think is not None and self.think.may_force(index - self.think.seen)

    def forced(self, index: int) -> int | None:
        """The token position `index` must be (reasoning ended by the engine), or None; every
        position before it is observed when it can be forced (`needs_previous`)."""
        think = self.think
        if think is None or think.seen != index:
            return None
        return think.forced()

    def process(self, history: mx.array | None, logits: mx.array) -> mx.array:
        for processor in self.processors:
            logits = processor(history if history is not None else mx.array([], mx.int32), logits)
        grammar = self.active_grammar
        if grammar is not None:
            logits = apply_token_mask(logits, grammar.mask(logits.shape[-1]))
        elif self.grammar is not None and self.think is not None and self.think.phase == "before":
            # A constrained reasoning row's first token: open the reasoning, or begin the answer.
            allowed = self.grammar.mask(logits.shape[-1]).copy()
            allowed[self.think.control.open_id] = True
            logits = apply_token_mask(logits, allowed)
        elif self.grammar is not None and self._eos is not None:
            # Its reasoning runs: it may not end before the answer its constraint asks for.
            logits[:, self._eos] = -float("inf")
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
    grammars = [g for s in samplers if (g := s.active_grammar) is not None]
    if len(grammars) > 1:
        from model.text.grammar import fill_masks

        fill_masks(grammars)


def logprobs_of(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
