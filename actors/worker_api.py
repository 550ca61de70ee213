"""The contract between the scheduler and a GPU worker.

The scheduler never touches MLX. It asks a worker, one awaited call at a time, to open a row,
prefill it chunk by chunk, join it to the running batch, step the batch, and close rows. The real
worker (`actors/gpu_worker.py`) runs each call as one job on its dedicated MLX thread; the fake
worker (`tests/fakes.py`) runs inline and spends virtual time, so MockClock tests are exact.

A call is never interrupted once started: cancellation takes effect at call boundaries, which are
exactly the "step boundaries" rows leave at. The one exception is `abort`, which is not a call
but a signal: a prefill forward of that row, running or still to come, stops early and the row
can then only be closed.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from model.rows import PrefillProgress, RowOpened, RowSpec, TokenOut


@attrs.frozen
class ModelInfo:
    """What the trio side needs to know about the loaded model (plain values only)."""

    name: str
    context_length: int  # max_position_embeddings
    weights_bytes: int
    kv_bytes_per_token: int
    eos_token_ids: frozenset[int]
    batchable: bool = True
    device: str = "cpu"
    # Memory the device can give this process (unified/GPU memory); 0 = unknown, in which case
    # admission's default budget falls back to system RAM.
    memory_bytes: int = 0
    # generation_config.json sampling defaults the checkpoint ships (only the keys it gives).
    generation_defaults: tuple[tuple[str, float], ...] = ()
    model_type: str = ""  # config.json's model_type (tool-call format detection falls back on it)


class Worker(Protocol):
    async def open_row(self, spec: RowSpec) -> RowOpened: ...

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress: ...

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]: ...

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]: ...

    async def join(self, row_id: int) -> TokenOut: ...

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]: ...

    async def step(self) -> list[TokenOut]: ...

    async def close_row(self, row_id: int, *, reusable: bool) -> None: ...

    def abort(self, row_id: int) -> None:
        """An opened row is leaving (it will be closed, not reused): a prefill forward of it
        stops at its next check between layers. Never blocks; safe while a call runs."""
        ...
