"""Plain-Python generation parameters shared by the actors (trio side) and the engine (MLX side).

Nothing here imports MLX, so request handlers can build these freely; the engine turns them into
logits processors and samplers on the GPU-worker thread.
"""

from __future__ import annotations

import attrs

# Constraint kinds (model/text/grammar.py compiles each; api/structured.py builds them from requests).
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "lark", "tool_call")


@attrs.frozen
class Constraint:
    """A structured-output constraint as plain data: it crosses the actor boundary inside
    SamplingParams and is compiled on the GPU-worker thread (cached per constraint).

    kind: "json_object" (spec ignored: any JSON object), "json_schema" (spec: the schema as JSON
    text), "regex" (spec: the pattern, matched in full), "choice" (spec: a JSON array of strings),
    "grammar" (spec: EBNF/GBNF, or Lark), "lark" (spec: llguidance Lark, may embed %json),
    "tool_call" (spec: JSON {"format": hermes | llama3_json | mistral | qwen3_coder, "mode": one |
    many | lazy, "tools": [{"name", "parameters", "strict"}]}: calls of the tools in the model's
    tool-call format, model/text/tool_grammar.py).
    strict: for json_schema, reject schema keywords the engine cannot enforce instead of
    ignoring them.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(CONSTRAINT_KINDS))
    spec: str = ""
    strict: bool = False


@attrs.frozen
class ThinkControl:
    """How a row's reasoning is followed, and ended (model/engine/reasoning.py), as plain data.

    The row reasons from the start when its prompt ends in an open reasoning block
    (`starts_in_reasoning`), else from the model's own `open_id`, until `close_id`. Once it has
    generated `budget` reasoning tokens the engine forces `close_id` and then `separator` (what
    the template writes between the reasoning and the answer). `constrain_after`: the row's
    constraint applies from the end of its reasoning (the first token may open it or start the
    constrained answer); a natural close is then followed by the forced separator too.
    """

    open_id: int
    close_id: int
    separator: tuple[int, ...] = ()
    starts_in_reasoning: bool = False
    budget: int | None = None  # None: reasoning is never cut short
    constrain_after: bool = False


@attrs.frozen
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 0.0  # 0 or 1 = off (mlx-lm convention)
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Always set by the time a row reaches the engine: an explicit request seed, or a fresh
    # default seed that is unique per request (see actors/admission.py).
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: the row samples only tokens the grammar allows (model/text/grammar.py).
    constraint: Constraint | None = None
    # The row's reasoning: followed for its budget and its constraint (None: not a reasoning row).
    think: ThinkControl | None = None

    @property
    def is_greedy(self) -> bool:
        """Plain argmax with no processors: the batch can sample it vectorized."""
        return (
            self.temperature == 0.0
            and not self.has_processors
            and self.xtc_probability == 0.0
            and self.constraint is None  # a grammar row masks its logits per row
        )

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.repetition_penalty not in (0.0, 1.0)
            or self.presence_penalty
            or self.frequency_penalty
        )
