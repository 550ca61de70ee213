"""The prompt-cache retention flag (`--cache-retention-share`): how much of the RAM prompt cache
entries put at a client's cache breakpoints (Anthropic `cache_control`) may hold protected from
LRU eviction until their deadlines. It fills `ServeConfig.cache_retention_share`."""

from __future__ import annotations

import argparse

DEFAULT_RETENTION_SHARE = 0.5


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def add_retention_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-retention-share",
        type=share,
        default=DEFAULT_RETENTION_SHARE,
        metavar="F",
        help="share of --prompt-cache that entries at clients' cache breakpoints (cache_control) may "
        "hold protected from eviction until their ttl ends (default 0.5; 0 = no protection)",
    )
