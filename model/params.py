"""Plain-Python generation parameters shared by the actors (trio side) and the engine (MLX side).

Nothing here imports MLX, so request handlers can build these freely; the engine turns them into
logits processors and samplers on the GPU-worker thread.
"""

from __future__ import annotations

import attrs


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

    @property
    def is_greedy(self) -> bool:
        """Plain argmax with no processors: the batch can sample it vectorized."""
        return (
            self.temperature == 0.0
            and not self.has_processors
            and self.xtc_probability == 0.0
        )

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.repetition_penalty not in (0.0, 1.0)
            or self.presence_penalty
            or self.frequency_penalty
        )
