"""Speculative decoding at start-up: the options' choice (`SpecChoice`, resolved with the rest of
the load plan) turned into the engine's `model.engine.speculation.Speculation` on the MLX thread
(model/engine/build.py).

A draft model must share the target's tokenizer vocabulary (its tokens are the target's
candidates): one that does not is refused at start-up like a bad --model. Speculation needs
full-precision KV caches, so under a quantizing --kv-quant it is switched off with a warning.
MLX is imported only inside `build_speculation`, which runs on the worker's thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from model.load.errors import ModelLoadError
from model.options import SpeculationOptions

if TYPE_CHECKING:
    from model.engine.speculation import Speculation

log = logging.getLogger(__name__)


@attrs.frozen
class SpecChoice:
    """What the command line asked for, with the draft model's directory resolved."""

    kind: str  # "draft" | "ngram"
    num_draft_tokens: int
    ngram_max: int
    ngram_min: int
    draft_dir: Path | None = None


def spec_choice(options: SpeculationOptions) -> SpecChoice | None:
    """The flags' speculative decoding, or None when it is off. Resolving --draft-model may raise
    ModelLoadError (a missing directory or cache entry): a bad command line, as for --model."""
    kind = options.kind
    if kind is None:
        return None
    draft_dir = None
    if kind == "draft" and options.draft_model:
        from model.load.resolve import resolve_model_dir

        draft_dir = Path(resolve_model_dir(options.draft_model))
    return SpecChoice(
        kind=kind,
        num_draft_tokens=options.num_draft_tokens,
        ngram_max=options.ngram_max,
        ngram_min=options.ngram_min,
        draft_dir=draft_dir,
    )


def build_speculation(
    choice: SpecChoice | None, target_dir: Path, *, kv_quantized: bool
) -> tuple[Speculation | None, str]:
    """The engine's Speculation and its label for ModelInfo ("" when off). On the MLX thread."""
    if choice is None:
        return None, ""
    if choice.draft_dir is not None:
        check_same_vocabulary(target_dir, choice.draft_dir)
    if kv_quantized:
        log.warning(
            "speculative decoding (--draft-kind %s) is off: it does not run on a quantized KV cache "
            "(--kv-quant); serving without it",
            choice.kind,
        )
        return None, ""
    from model.engine.speculation import Speculation
    from model.load.loader import load_model

    draft = load_model(choice.draft_dir) if choice.draft_dir is not None else None
    speculation = Speculation(
        kind=choice.kind,
        num_draft_tokens=choice.num_draft_tokens,
        draft_model=None if draft is None else draft.model,
        ngram_max=choice.ngram_max,
        ngram_min=choice.ngram_min,
    )
    if draft is not None:
        return speculation, f"draft:{draft.name} k={choice.num_draft_tokens}"
    return speculation, f"ngram k={choice.num_draft_tokens} n={choice.ngram_min}..{choice.ngram_max}"


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """Raise ModelLoadError (one line) unless both tokenizers map every piece to the same id."""
    from model.text.tokenizer import Tokenizer

    try:
        target, draft = Tokenizer.from_dir(target_dir).vocab(), Tokenizer.from_dir(draft_dir).vocab()
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    if target != draft:
        only = len(target.keys() ^ draft.keys())
        moved = sum(1 for piece, i in target.items() if piece in draft and draft[piece] != i)
        raise ModelLoadError(
            f"--draft-model {draft_dir} cannot draft for --model {target_dir}: their tokenizer vocabularies "
            f"differ ({len(draft)} vs {len(target)} tokens, {only} in only one, {moved} with another id)"
        )
