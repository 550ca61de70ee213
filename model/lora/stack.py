"""Which LoRA adapters one row may stack: one rule, and one message, for the API's check, the
registry's check on the MLX thread and the engine's own (no MLX here: the trio side imports it,
and the command line must not load MLX before --blas acts).

A DoRA adapter rescales its layers' whole outputs (model/lora/mount.py), so it runs alone; plain LoRA
adapters stack freely (their deltas summed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

DORA = "dora"  # a `fine_tune_type` (model/lora/load.py)


class AdapterKind(Protocol):
    """What the rule reads of an adapter: model/lora/load.py `Adapter`, model/lora/adapters.py
    `AdapterInfo`, actors/worker_api.py `AdapterReport`."""

    @property
    def id(self) -> str: ...

    @property
    def fine_tune_type(self) -> str: ...


def stack_problem(adapters: Sequence[AdapterKind]) -> str | None:
    """Why these adapters cannot run stacked on one row, or None when they can."""
    dora = [a.id for a in adapters if a.fine_tune_type == DORA]
    if len(adapters) > 1 and dora:
        return f"adapter {dora[0]!r} is a DoRA adapter, which cannot be stacked with another: select it alone"
    return None
