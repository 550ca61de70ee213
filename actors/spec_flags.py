"""The speculative-decoding flags (`--draft-model`, `--draft-kind`, `--num-draft-tokens`,
`--ngram-max`, `--ngram-min`).

They fill `ServeConfig`'s fields of the same names; the worker builds a
`model.speculation.Speculation` from them once the target is loaded (actors/speculation_setup.py).
"""

from __future__ import annotations

import argparse

from actors.flag_types import path_arg
from model.speculation import DEFAULT_DRAFT_TOKENS, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN

DRAFT_KINDS = ("draft", "ngram")


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="speculative decoding with this small draft model (a directory or an org/name in the local "
        "Hugging Face cache, as --model); it must share the target's tokenizer vocabulary",
    )
    p.add_argument(
        "--draft-kind",
        choices=DRAFT_KINDS,
        default=None,
        help="who proposes the draft tokens the model verifies: draft = --draft-model, ngram = prompt lookup "
        "(the tokens that followed the row's latest n-gram earlier in its prompt and output). Default: draft "
        "when --draft-model is given, else no speculative decoding",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=_at_least_one,
        default=DEFAULT_DRAFT_TOKENS,
        metavar="K",
        help=f"draft tokens proposed per verification step (default {DEFAULT_DRAFT_TOKENS})",
    )
    p.add_argument(
        "--ngram-max",
        type=_at_least_one,
        default=DEFAULT_NGRAM_MAX,
        metavar="N",
        help=f"--draft-kind ngram: the longest trailing n-gram looked up (default {DEFAULT_NGRAM_MAX})",
    )
    p.add_argument(
        "--ngram-min",
        type=_at_least_one,
        default=DEFAULT_NGRAM_MIN,
        metavar="N",
        help=f"--draft-kind ngram: the shortest trailing n-gram looked up (default {DEFAULT_NGRAM_MIN})",
    )


def check_spec_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args`, once the combinations argparse cannot check flag by flag are sound (a bad one
    exits 2 with the usage line)."""
    if args.draft_kind == "draft" and not args.draft_model:
        p.error("--draft-kind draft needs --draft-model")
    if args.draft_kind == "ngram" and args.draft_model:
        p.error("--draft-model is only used with --draft-kind draft")
    if args.ngram_min > args.ngram_max:
        p.error("--ngram-min must not exceed --ngram-max")
    return args


def draft_kind(kind: str | None, draft_model: str | None) -> str | None:
    """The effective drafter: an explicit --draft-kind, else draft when a draft model is given;
    None = no speculative decoding."""
    if kind is not None:
        return kind
    return "draft" if draft_model else None


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value
