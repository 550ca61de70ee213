"""Stopping a prefill forward between layers once its row is aborted.

A prefill chunk is one lazy MLX graph, and once `mx.eval` runs it nothing can stop it: without a
check inside, an abort lands only when the whole chunk (2048 tokens: seconds on a CPU) is done,
and the next request waits that long for the worker. So a prefill forward evaluates its hidden
state every few layers (`LayerCheckpoints`) and asks whether every row it serves was aborted
(model/engine/abort_flags.py, set from the trio thread while the forward runs); if so it raises
`PrefillAborted` and the engine drops the rows' partial KV. Evaluating a graph in pieces runs the
same kernels on the same inputs, so the result is bit for bit that of one evaluation.

CPU: every layer, waiting for it — a host sync costs microseconds against the tens to hundreds
of milliseconds a layer of a long chunk takes (measured: no difference on a 4-layer model's
2048-token chunks). GPU: every `GPU_EVERY` layers, one checkpoint ahead: the layers just built
are queued (`async_eval`) before the host waits for the previous checkpoint, which the device is
already running, so it never idles on a check (without checks it idles while the host builds
the whole chunk's graph). An abort then lands within about two checkpoints (4 layers; for an
8B model's 2048-token chunk, estimated at about one decode step: benchmarks/prefill_abort_cost.py
measures the cost and the latency).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from model.engine.abort_flags import AbortFlags
from model.kv.cache import LayerCache

if TYPE_CHECKING:
    from model.engine.decoding import Row
    from model.nn.language_model import LanguageModel

GPU_EVERY = 2


class PrefillAborted(Exception):
    """Every row of a prefill forward was aborted while it ran: its KV is partial."""


class LayerCheckpoints:
    """`after_layer(index, hidden)` for a forward of `layers` blocks: evaluates the hidden state
    every `every` layers and raises `PrefillAborted` when `stop()` says so. `ahead`: keep one
    checkpoint queued on the device while waiting for the one before (GPU).

    Never after the last block: a prefill evaluates only the caches, and the last block's KV
    comes from the hidden state before it, so its attention and MLP are never computed (a
    check there would compute them: +30% on a 4-layer CPU model's chunk)."""

    def __init__(self, stop: Callable[[], bool], layers: int, *, every: int = 1, ahead: bool = False) -> None:
        self.stop = stop
        self.last = layers - 1
        self.every = max(1, every)
        self.ahead = ahead
        self._pending: mx.array | None = None

    @classmethod
    def for_device(cls, stop: Callable[[], bool], layers: int, *, gpu: bool) -> LayerCheckpoints:
        return cls(stop, layers, every=GPU_EVERY, ahead=True) if gpu else cls(stop, layers)

    def __call__(self, index: int, hidden: mx.array) -> None:
        if (index + 1) % self.every or index >= self.last:
            return
        if self.ahead:
            mx.async_eval(hidden)
            pending, self._pending = self._pending, hidden
            if pending is not None:
                mx.eval(pending)
        else:
            mx.eval(hidden)
        if self.stop():
            raise PrefillAborted


def forward_unless_aborted(
    model: LanguageModel,
    tokens: mx.array,
    caches: Sequence[LayerCache],
    rows: Sequence[Row],
    aborts: AbortFlags,
    gpu: bool,
    unfused_attention: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> bool:
    """`model(tokens, caches)` for these rows' prefill, stopping between layers once every one
    of them is aborted. False then: some layers hold the chunk's KV and others not, so the rows'
    caches are dropped (a partial prefill is never put to the prompt cache) and they can only
    close. The hidden state is not needed: the caller evaluates the caches. `inputs`: the forward's
    extra arguments (an image row's embeddings and positions: model/engine/image_rows.py)."""
    ids = [r.row_id for r in rows]
    stops = LayerCheckpoints.for_device(lambda: aborts.all_of(ids), len(caches), gpu=gpu)
    try:
        model(tokens, caches, unfused_attention=unfused_attention, after_layer=stops, **(inputs or {}))
    except PrefillAborted:
        for row in rows:
            row.caches, row.processed, row.snapshots, row.aborted = [], 0, [], True
        return False
    return True
