"""Pure admission policy: no trio, no I/O, no clocks except injected ones.

Admission (`actors/admission.py`) and the composition root (`actors/root.py`) are thin around
these rules — where a request runs, its seed, the memory budget, how many rows decode at once — so
each can be tested as a plain function call. The scheduler's own rules are in
`actors/scheduling.py`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
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


def place(*, mode: BatchMode) -> Lane:
    """The lane is the server's mode, never the request's fields or the current load.

    A seeded request is batched like any other: each row samples from its own (seed, step) key
    (model/engine/sampling.py), so a seed gives the same tokens alone and beside other rows wherever the
    logits are the same (always on CPU; on CUDA a wider step can round differently, as it can
    for greedy rows).
    """
    return "batched" if mode == "batch" else "serial"


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


# --- the wait queue --------------------------------------------------------------------------


def waiting_rows(*, pending: int, active: int, capacity: int, mode: BatchMode) -> int:
    """The admitted rows that must wait for a running row to leave: those beyond the free rows.

    `pending`: rows admitted and not opened yet; `active`: rows opened (running, prefilling,
    staged). Each choice of a request (`n`) is a row. A batched server runs `capacity` rows at
    once, a serial one a row at a time whatever `--batch` says. `--max-queue` bounds this count:
    a row that fits a free slot starts at once, so it never counts as waiting.
    """
    slots = capacity if mode == "batch" else 1
    return max(0, pending - max(0, slots - active))


# --- memory admission ------------------------------------------------------------------------

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


# A row's KV buffers grow this many positions at a time (model/kv/cache.py STEP): the live-KV
# budget bills a row in whole steps (actors/kv_memory.py).
GROWTH_TOKENS = 256


@attrs.frozen
class KvRate:
    """How admission bills one row's memory (`kv_bill`, then its fixed recurrent state)."""

    bytes_per_token: int
    quant_ratio: float = 1.0
    quantized_from: int = 0
    state_bytes_per_row: int = 0


@attrs.frozen
class AdmissionCeiling:
    """Two limits on a request's rows, kept apart: the model's context `window` bounds each row
    alone, the memory budget bounds the sum of its rows' KV (`memory_context`)."""

    memory_budget_bytes: int
    usable_bytes: int  # budget − weights (every resident model's) − mounted adapters − prefill transient (may be < 0)
    weights_bytes: int
    transient_bytes: int  # one prefill forward's peak (the chunk in use, the model's shape)
    max_safe_context: int  # the longest one row alone may grow to: min(memory, window)
    adapter_bytes: int = 0  # the mounted LoRA adapters' weights
    context_length: int = 0  # the model's window, per row (0: not known, memory alone bounds)
    kv_rate: KvRate | None = None  # None: the budget holds one row of `max_safe_context`, linearly
    kv_budget_bytes: int | None = None  # --kv-budget when given: `usable_bytes` is at most it
    other_weights_bytes: int = 0  # a model pool's other resident models (actors/pool.py)

    def memory_context(self, rows: int = 1) -> int:
        """The longest each of `rows` rows of one request may grow to, side by side in the budget.
        Each holds its own copy of the prompt's KV: choices fork from one prefill as views, but
        their first write or the batch merge copies them (model/engine/engine.py `fork_rows`).
        Under an explicit live-KV budget, in whole `GROWTH_TOKENS` steps: the scheduler bills a
        row's KV as the buffers it grows by, and lets a lone row grow unchecked."""
        rows = max(1, rows)
        rate = self.kv_rate
        if rate is None:
            return self.max_safe_context // rows
        if rate.bytes_per_token <= 0:  # no KV grows with the row: only the window bounds it
            return self.context_length or self.max_safe_context
        tokens = max_tokens_billed(
            self.usable_bytes // rows - rate.state_bytes_per_row,  # (a row's fixed state comes first)
            kv_bytes_per_token=rate.bytes_per_token,
            kv_quant_ratio=rate.quant_ratio,
            kv_quantized_from=rate.quantized_from,
        )
        if self.kv_budget_bytes:  # (its last step is allocated whole: it must fit too)
            tokens -= tokens % GROWTH_TOKENS
        return tokens


def kv_bill(tokens: int, *, kv_bytes_per_token: int, kv_quant_ratio: float = 1.0, kv_quantized_from: int = 0) -> int:
    """The KV bytes a row of `tokens` positions may hold. A quantized scheme stores a row in full
    precision until its rows turn quantized (`kv_quantized_from`, 0 = never), then every position
    at `kv_quant_ratio` of that rate: the larger of the two is what the row ever needs."""
    full = kv_bytes_per_token * tokens
    if kv_quantized_from <= 0 or kv_quant_ratio >= 1.0:
        return full
    return max(kv_bytes_per_token * min(tokens, kv_quantized_from), math.ceil(full * kv_quant_ratio))


def max_tokens_billed(
    usable_bytes: int, *, kv_bytes_per_token: int, kv_quant_ratio: float = 1.0, kv_quantized_from: int = 0
) -> int:
    """The most positions a row can hold with `kv_bill(n) <= usable_bytes` (0 when none)."""
    if usable_bytes <= 0:
        return 0
    fp_tokens = usable_bytes // kv_bytes_per_token
    if kv_quantized_from <= 0 or kv_quant_ratio >= 1.0 or fp_tokens < kv_quantized_from:
        return fp_tokens  # the full-precision part alone fills the budget
    tokens = int(usable_bytes / (kv_bytes_per_token * kv_quant_ratio))
    start = kv_quantized_from

    def bill(n: int) -> int:
        return kv_bill(n, kv_bytes_per_token=kv_bytes_per_token, kv_quant_ratio=kv_quant_ratio, kv_quantized_from=start)

    while tokens > 0 and bill(tokens) > usable_bytes:  # float rounding: settle on the exact bill
        tokens -= 1
    while bill(tokens + 1) <= usable_bytes:
        tokens += 1
    return tokens


def admission_ceiling(
    *,
    budget_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    context_length: int,
    transient_bytes: int,
    kv_quant_ratio: float = 1.0,
    kv_quantized_from: int = 0,
    adapter_bytes: int = 0,
    state_bytes_per_row: int = 0,
    kv_budget_bytes: int | None = None,
    other_weights_bytes: int = 0,
) -> AdmissionCeiling:
    """The limits of one request's rows: the model's context window per row, and the KV the
    budget holds after weights, the mounted adapters' weights and the prefill transient
    (`transient_bytes`: model/engine/prefill_memory.py), billed at the scheme's true bytes (`kv_bill`);
    `max_safe_context` is the smaller, for one row. An explicit live-KV budget (`--kv-budget`)
    bounds a request's rows too: they could never run together under it. In a model pool the
    other resident models' weights (`other_weights_bytes`) share the budget too."""
    rate = KvRate(kv_bytes_per_token, kv_quant_ratio, kv_quantized_from, state_bytes_per_row)
    usable = budget_bytes - weights_bytes - adapter_bytes - other_weights_bytes - transient_bytes
    if kv_budget_bytes:
        usable = min(usable, kv_budget_bytes)
    ceiling = AdmissionCeiling(
        memory_budget_bytes=budget_bytes,
        usable_bytes=usable,
        weights_bytes=weights_bytes,
        transient_bytes=transient_bytes,
        max_safe_context=0,
        adapter_bytes=adapter_bytes,
        context_length=context_length,
        kv_rate=rate,
        kv_budget_bytes=kv_budget_bytes,
        other_weights_bytes=other_weights_bytes,
    )
    return attrs.evolve(ceiling, max_safe_context=max(0, min(ceiling.memory_context(1), context_length)))


def over_budget_message(prompt_tokens: int, max_safe_context: int, *, choices: int = 1) -> str:
    if choices > 1:
        return (
            f"prompt is {prompt_tokens} tokens but the memory budget caps safe context at "
            f"{max_safe_context} for each of the request's {choices} choices (each holds its own copy "
            f"of the prompt's KV) — no room to generate; shorten the prompt, ask for fewer choices "
            f"or raise --memory-budget"
        )
    return (
        f"prompt is {prompt_tokens} tokens but the memory budget caps safe context at "
        f"{max_safe_context} — no room to generate; shorten the prompt or raise --memory-budget"
    )


def fit_rows(
    ceiling: AdmissionCeiling, *, prompt_tokens: int, max_tokens: int, rows: int = 1
) -> int | Literal["window", "memory"]:
    """`max_tokens` clamped to the room each of a request's `rows` rows has (its `n` choices):
    the model's window bounds each row alone, the memory budget all of them together. Else the
    limit that leaves the prompt no room: "window" first (no budget can fix it), then "memory"."""
    window = ceiling.context_length
    if 0 < window <= prompt_tokens:
        return "window"
    memory = ceiling.memory_context(rows)
    if memory <= prompt_tokens:
        return "memory"
    room = min(window, memory) if window > 0 else memory
    return min(max_tokens, room - prompt_tokens)


def device_memory(
    device: str, device_info: Mapping[str, object], *, ram_bytes: int, free_bytes: int | None = None, own_bytes: int = 0
) -> int:
    """What the model's device can hold, from `mx.device_info()`: CUDA reports `total_memory`
    (GPU memory), Metal `max_recommended_working_set_size` (what the GPU may keep resident;
    its `memory_size` is all of RAM); on CPU, or when neither key is there, system RAM. With
    `free_bytes` (CUDA's free memory, read once the model is loaded), at most that plus what this
    process holds (`own_bytes`): memory another process holds is not ours to budget."""
    if device != "cpu":
        for key in ("total_memory", "max_recommended_working_set_size", "memory_size"):
            value = device_info.get(key)
            if isinstance(value, int) and value > 0:
                return value if free_bytes is None else min(value, free_bytes + own_bytes)
    return ram_bytes


# --- batch width -----------------------------------------------------------------------------

# `--batch auto`: mlx_lm.server decodes 32 rows at once by default, and every side-by-side run in
# docs/performance.md (H100, H200 and CPU) gave ours 32 rows; 8 rows leave 24 of 32 concurrent
# requests queued. On CPU the engine's B=32 decode gave 1.8x B=8's tokens/s. So 32 on every
# device, fewer only where their KV does not fit.
AUTO_BATCH_ROWS = 32
# The context each auto row is given room for in the KV budget (a chat turn with a system
# prompt); a row may grow past it, admission still caps each one at the max safe context.
AUTO_ROW_CONTEXT = 2048


def resolve_batch(
    requested: int | None,
    *,
    budget_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    context_length: int,
    transient_bytes: int,
    kv_quant_ratio: float = 1.0,
    kv_quantized_from: int = 0,
    state_bytes_per_row: int = 0,
) -> int:
    """The rows that decode at once: `requested` as given, or for auto (None) `AUTO_BATCH_ROWS`,
    fewer when that many rows of `AUTO_ROW_CONTEXT` tokens (or the model's whole context, if
    shorter) would not fit the KV room the budget leaves after weights and the prefill transient
    (a row billed as admission bills it: `kv_bill`); never below 1 (then the strict serial
    executor)."""
    if requested is not None:
        return requested
    row_bytes = (
        kv_bill(
            min(AUTO_ROW_CONTEXT, context_length),
            kv_bytes_per_token=kv_bytes_per_token,
            kv_quant_ratio=kv_quant_ratio,
            kv_quantized_from=kv_quantized_from,
        )
        + state_bytes_per_row
    )
    if row_bytes <= 0:
        return AUTO_BATCH_ROWS
    usable = budget_bytes - weights_bytes - transient_bytes
    return max(1, min(AUTO_BATCH_ROWS, usable // row_bytes))
