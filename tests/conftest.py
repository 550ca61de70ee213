"""Shared pytest fixtures.

Test rules for this suite:

* Network: localhost only, and servers bind port 0 (the OS picks a free port) so tests can run
  in parallel.
* Time: anything timed (timeouts, idle timers, demotion, backoff) runs under trio's
  `autojump_clock` (MockClock), never real sleeps.
* Real-engine tests (actual MLX forward passes) get a generous `trio.fail_after`, so a hang fails
  the test instead of the run, without flaking on a slow CI machine.
* Models: tiny synthetic ones only (hidden_size <= 256), written by `tests.fixtures.synth`; never
  a downloaded checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.synth import write_model_dir


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(family="qwen3", dtype="float32", quant=None, **kw) -> Path`; write_model_dir's
    keyword arguments. Each distinct argument set is written once per session and shared, so
    tests must treat the directories as read-only."""
    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def make(family: str = "qwen3", dtype: str = "float32", quant: str | None = None, **kw: Any) -> Path:
        args = {"family": family, "dtype": dtype, "quant": quant, **kw}
        key = repr(sorted(args.items()))
        if key not in made:
            made[key] = write_model_dir(root / f"m{len(made)}-{family}-{dtype}-{quant}", **args)
        return made[key]

    return make


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", template="llama3", rope_scaling="llama3")
