"""The LoRA adapter flags: `--adapter ID=PATH` (repeatable) and `--adapters-dir DIR`.

`--adapter` fills `ServeConfig.adapters` ((id, path) pairs, mounted in order once the model is
loaded: actors/root.py; one that cannot mount fails start-up in one line, exit 2).
`--adapters-dir` fills `ServeConfig.adapters_dir`, the directory GET /v1/adapters/available lists
(api/adapter_routes.py); nothing in it is mounted until asked.
"""

from __future__ import annotations

import argparse
from typing import Any

from actors.flag_types import path_arg
from model.adapter_ids import adapter_id_problem


def add_adapter_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        dest="adapters",
        action=_AppendAdapter,
        type=parse_adapter,
        default=[],
        metavar="ID=PATH",
        help="mount the LoRA / DoRA adapter directory PATH (mlx-lm's adapter_config.json + "
        "adapters.safetensors) under ID once the model is loaded; repeatable. Requests pick it with "
        '"adapter": "ID" or "model": "<served-name>:ID" (default: none)',
    )
    p.add_argument(
        "--adapters-dir",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="a directory of adapter directories that GET /v1/adapters/available lists, for POST "
        "/v1/adapters to mount at runtime (default: none)",
    )


def parse_adapter(text: str) -> tuple[str, str]:
    """`ID=PATH` → (id, path with `~` expanded); a bad one is argparse's usage error (exit 2)."""
    adapter_id, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError("must be ID=PATH")
    if problem := adapter_id_problem(adapter_id):
        raise argparse.ArgumentTypeError(problem)
    return adapter_id, path_arg(path)


class _AppendAdapter(argparse.Action):
    """argparse's append, refusing an id given twice (exit 2 with the usage line)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        given = list(getattr(namespace, self.dest) or [])  # a copy: never the shared default
        if any(adapter_id == values[0] for adapter_id, _ in given):
            parser.error(f"--adapter {values[0]} is given more than once")
        setattr(namespace, self.dest, [*given, values])
