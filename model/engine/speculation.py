"""Speculative decoding settings and the n-gram (prompt lookup) drafter.

A drafter proposes up to K next tokens for a row; the target checks them all in one forward and
keeps the longest prefix its own sampling would have produced (model/engine/speculative_step.py), so
greedy output is exactly that of plain decoding. Two drafters: a small `draft_model` sharing the
target's tokenizer, and `ngram` — the continuation of the latest earlier occurrence of the row's
trailing n-gram in its prompt and output (coding agents re-emit their context: file edits, tool
arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from model.options import SpeculationOptions
from model.options.flags import default_of

if TYPE_CHECKING:
    from model.nn.language_model import LanguageModel


@attrs.frozen
class Speculation:
    kind: str  # "draft" (a draft model) or "ngram"
    num_draft_tokens: int = default_of(SpeculationOptions, "num_draft_tokens")
    draft_model: LanguageModel | None = attrs.field(default=None, eq=False)
    ngram_max: int = default_of(SpeculationOptions, "ngram_max")
    ngram_min: int = default_of(SpeculationOptions, "ngram_min")
    # Verify drafts at every step, not only while measured faster (benchmarks, tests).
    always: bool = False

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("draft", "ngram"):
            raise ValueError(f"unknown draft kind {self.kind!r} (draft, ngram)")
        if self.kind == "draft" and self.draft_model is None:
            raise ValueError("--draft-kind draft needs --draft-model")
        if self.num_draft_tokens < 1:
            raise ValueError("--num-draft-tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= --ngram-min <= --ngram-max")


def ngram_drafts(tokens: Sequence[int] | np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest trailing n-gram
    (n from ngram_max down to ngram_min) of `tokens`; [] when none recurs. Vectorized: a 32k-token
    context costs tens of microseconds, not a Python loop over it."""
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        tail = arr[total - n :]
        starts = np.flatnonzero(arr[: total - n] == tail[0])  # earlier occurrences of its first token
        for j in range(1, n):
            starts = starts[arr[starts + j] == tail[j]]
        if len(starts):
            start = int(starts[-1])  # the latest match: recent context is the likeliest repeated
            follow = arr[start + n : start + n + k]
            if len(follow):
                return [int(t) for t in follow]
    return []


class SpecPolicy:
    """Whether a decode step of a batch of `width` rows speculates, from what this server has
    measured: seconds per plain step and per verification, and tokens per verification, by
    batch width (moving averages). It speculates while a verification's tokens per second beat
    plain steps', and re-measures the other choice every `PROBE_EVERY` steps. The output does
    not depend on it (model/engine/speculative_step.py): only speed does.

    A width's first sample of each kind is not kept (it pays for tracing and compiling a new
    shape), and a sample under half the average replaces it: one slow outlier must not hold a
    choice for hundreds of steps, since the loser is re-measured only once per `PROBE_EVERY`
    (H100: a first verification that compiled kept n-gram drafting off where it was 2x faster)."""

    PROBE_EVERY = 32
    WEIGHT = 0.2  # of a new measurement in a moving average

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # width -> seconds per plain step
        self.spec: dict[int, tuple[float, float]] = {}  # width -> (seconds, tokens) per verification
        self.idle: dict[int, int] = {}  # width -> steps left before drafting is tried again
        self._steps = 0
        self._warm: set[tuple[str, int]] = set()  # (kind, width) whose first sample was dropped

    def speculate(self, width: int) -> bool:
        self._steps += 1
        if self.idle.get(width, 0) > 0:
            self.idle[width] -= 1
            return False
        plain, spec = self.plain.get(width), self.spec.get(width)
        if spec is None or plain is None:
            return spec is None  # measure each once: a verification first
        probe = self._steps % self.PROBE_EVERY == 0
        faster = spec[1] / spec[0] >= width / plain
        return faster != probe

    def _warmed(self, kind: str, width: int) -> bool:
        if (kind, width) in self._warm:
            return True
        self._warm.add((kind, width))
        return False

    def plain_done(self, width: int, seconds: float) -> None:
        if not self._warmed("plain", width):
            return
        old = self.plain.get(width)
        if old is None or seconds < old / 2:
            self.plain[width] = seconds
        else:
            self.plain[width] = old + self.WEIGHT * (seconds - old)

    def spec_done(self, width: int, seconds: float, tokens: int) -> None:
        if not self._warmed("spec", width):
            return
        old = self.spec.get(width)
        if old is None or seconds / max(tokens, 1) < old[0] / max(old[1], 1) / 2:
            self.spec[width] = (seconds, float(tokens))
        else:
            w = self.WEIGHT
            self.spec[width] = (old[0] + w * (seconds - old[0]), old[1] + w * (tokens - old[1]))

    def nothing_to_draft(self, width: int) -> None:
        """No row had a draft (n-gram lookup found nothing): plain steps for a while."""
        self.idle[width] = self.PROBE_EVERY // 4
