"""`--tensor-parallel N`: split the model across N processes on this host over MLX's ring backend
(actors/tp_leader.py; docs/operations.md). Fills `ServeConfig.tensor_parallel`; 1 = one process."""

from __future__ import annotations

import argparse

from actors.flag_types import at_least_one


def add_tensor_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel",
        type=at_least_one,
        default=1,
        metavar="N",
        help="split attention heads and MLP across N ranks: this process and N-1 follower processes it starts, "
        "joined by MLX's ring backend on localhost; the heads must divide by N. Turns the prompt cache off; "
        "not with --ssd-cache, speculative decoding, adapters or embedding models (default 1 = off)",
    )
