"""Pure admission policy: no trio, no I/O, no clocks except injected ones.

Admission (`actors/admission.py`) and the composition root (`actors/root.py`) are thin around
these rules — where a request runs, its seed, the memory budget — so each can be tested as a
plain function call. The scheduler's own rules are in `actors/scheduling.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Literal

import attrs

from actors.messages import Lane

BatchMode = Literal["off", "serial", "batch"]

# --- placement and seeds ---------------------------------------------------------------------


def batch_mode(batch: int, *, batchable: bool) -> BatchMode:
    """`--batch 1` pins the strict serial executor; a model whose caches cannot batch is `serial`."""
    if batch <= 1:
        return "off"
    return "batch" if batchable else "serial"


def place(*, explicit_seed: bool, mode: BatchMode) -> Lane:
    """The mechanism is frozen per request from the request alone, never from current load.

    An explicit seed promises reproducibility, and only a row running alone is reproducible
    whatever else is running (per-row RNG streams are exact, left-pad reduction order is not).
    """
    if mode == "batch" and not explicit_seed:
        return "batched"
    return "serial"


_GOLDEN_32 = 0x9E3779B9  # odd, so the Weyl sequence visits every 32-bit value before repeating
_MASK_32 = 0xFFFFFFFF


class SeedSource:
    """Default seeds: wall-clock milliseconds XOR a golden-ratio Weyl counter.

    Batched rows key their RNG by (seed, step); two requests in the same millisecond sharing a
    seed would make identical prompts sample identical outputs. The Weyl term differs on every
    call, so equal timestamps can never give equal seeds. 32 bits so any RNG accepts it.
    """

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._weyl = 0

    def next(self) -> int:
        self._weyl = (self._weyl + _GOLDEN_32) & _MASK_32
        return (self._clock_ms() ^ self._weyl) & _MASK_32


# --- memory admission ------------------------------------------------------------------------

PREFILL_CHUNK_TOKENS = 2048
PREFILL_BYTES_PER_TOKEN = 550_000  # 0.55 MB per chunk token: activations of one 2048-token chunk
PREFILL_TRANSIENT_BYTES = PREFILL_CHUNK_TOKENS * PREFILL_BYTES_PER_TOKEN
DEFAULT_BUDGET_FRACTION = 0.75


def system_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def memory_budget_bytes(budget_gb: float | None, *, device_memory_bytes: int = 0) -> int:
    """`--memory-budget` is decimal GB; the default leaves a quarter of memory to everything else."""
    if budget_gb is not None:
        return int(budget_gb * 1e9)
    total = device_memory_bytes or system_memory_bytes()
    return int(total * DEFAULT_BUDGET_FRACTION)


@attrs.frozen
class AdmissionCeiling:
    memory_budget_bytes: int
    usable_bytes: int  # budget − weights − prefill transient (may be negative)
    weights_bytes: int
    max_safe_context: int


def admission_ceiling(
    *, budget_bytes: int, weights_bytes: int, kv_bytes_per_token: int, context_length: int
) -> AdmissionCeiling:
    usable = budget_bytes - weights_bytes - PREFILL_TRANSIENT_BYTES
    by_memory = usable // kv_bytes_per_token if kv_bytes_per_token > 0 else context_length
    return AdmissionCeiling(
        memory_budget_bytes=budget_bytes,
        usable_bytes=usable,
        weights_bytes=weights_bytes,
        max_safe_context=max(0, min(by_memory, context_length)),
    )


def over_budget_message(prompt_tokens: int, max_safe_context: int) -> str:
    return (
        f"prompt is {prompt_tokens} tokens but the memory budget caps safe context at "
        f"{max_safe_context} — no room to generate; shorten the prompt or raise --memory-budget"
    )


def clamp_max_tokens(prompt_tokens: int, requested: int, max_safe_context: int) -> int | None:
    """max_tokens is a ceiling, not a promise: clamp to the room left; None = no room at all."""
    available = max_safe_context - prompt_tokens
    if available < 1:
        return None
    return min(requested, available)
