"""Speculative decoding settings and the n-gram (prompt lookup) drafter.

A drafter proposes up to K next tokens for a row; the target checks them all in one forward and
keeps the longest prefix its own sampling would have produced (model/speculative_step.py), so
greedy output is exactly that of plain decoding. Two drafters: a small `draft_model` sharing the
target's tokenizer, and `ngram` — the continuation of the latest earlier occurrence of the row's
trailing n-gram in its prompt and output (coding agents re-emit their context: file edits, tool
arguments).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from model.language_model import LanguageModel

DEFAULT_DRAFT_TOKENS = 3
DEFAULT_NGRAM_MAX = 4
DEFAULT_NGRAM_MIN = 2


@attrs.frozen
class Speculation:
    kind: str  # "draft" (a draft model) or "ngram"
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_model: LanguageModel | None = attrs.field(default=None, eq=False)
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("draft", "ngram"):
            raise ValueError(f"unknown draft kind {self.kind!r} (draft, ngram)")
        if self.kind == "draft" and self.draft_model is None:
            raise ValueError("--draft-kind draft needs --draft-model")
        if self.num_draft_tokens < 1:
            raise ValueError("--num-draft-tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= --ngram-min <= --ngram-max")


def ngram_drafts(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest trailing n-gram
    (n from ngram_max down to ngram_min) of `tokens`; [] when none recurs."""
    total = len(tokens)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        tail = list(tokens[total - n :])
        # The latest match wins: recent context is the likeliest to be repeated next.
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []
