"""The contract between the scheduler and a GPU worker.

The scheduler never touches MLX. It asks a worker, one awaited call at a time, to open a row,
prefill it chunk by chunk, join it to the running batch, step the batch, and close rows. The real
worker (`actors/gpu_worker.py`) runs each call as one job on its dedicated MLX thread; the fake
worker (`tests/fakes.py`) runs inline and spends virtual time, so MockClock tests are exact.

A call is never interrupted once started: cancellation takes effect at call boundaries, which are
exactly the "step boundaries" rows leave at.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from model.params import SamplingParams


@attrs.frozen
class RowSpec:
    row_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    namespace: str = ""  # prompt-cache namespace (adapter ids; "" = base model)
    # Template-stable prefix length (cache/boundary.py): the engine snapshots the KV there so the
    # next turn of the conversation hits. None = no snapshot.
    snapshot_at: int | None = None
    # A cached prefix shorter than this is not restored: the scheduler asks for it when it opens
    # rows to prefill together, where a short hit would only keep the row out of the group.
    min_cached_tokens: int = 1


@attrs.frozen
class RowOpened:
    row_id: int
    cached_tokens: int  # prompt tokens restored from the prompt cache
    to_prefill: int  # prompt tokens still to forward before token 0 (excludes the last token)


@attrs.frozen
class PrefillProgress:
    row_id: int
    done: int  # prompt tokens whose KV is now in the row's cache
    remaining: int  # 0 => the row is ready to join


@attrs.frozen
class TopLogprob:
    token: int
    logprob: float


@attrs.frozen
class TokenOut:
    row_id: int
    token: int
    # None while the row continues; "stop" on an EOS token; "length" when max_tokens is reached.
    finish: str | None = None
    logprob: float | None = None  # only when the row asked for logprobs
    top_logprobs: tuple[TopLogprob, ...] = ()


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

    async def join(self, row_id: int) -> TokenOut: ...

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]: ...

    async def step(self) -> list[TokenOut]: ...

    async def close_row(self, row_id: int, *, reusable: bool) -> None: ...
