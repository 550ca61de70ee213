"""The real GPU worker, built as tests need it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from actors.gpu_worker import GpuWorker
from actors.options import options


def gpu_worker(
    model_dir: Path | str,
    *,
    name: str | None = None,
    eos_token_ids: Iterable[int] | None = None,
    protected_ids: Iterable[int] = (),
    **fields: Any,
) -> GpuWorker:
    """A `GpuWorker` with options set by their flat field names (`prefill_chunk=64`, `kv_quant="8"`).
    Unlike the server, its prompt cache is off unless `prompt_cache_gb` is given: most engine
    tests compare cold runs."""
    fields.setdefault("prompt_cache_gb", 0)
    return GpuWorker(
        Path(model_dir), options(**fields), name=name, eos_token_ids=eos_token_ids, protected_ids=protected_ids
    )
