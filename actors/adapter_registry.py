"""The LoRA adapters mounted on the worker, as the trio side keeps them.

Mounting and unmounting are worker calls (`Worker.mount_adapter` / `unmount_adapter`, run on the
MLX thread between other calls); this registry serializes them and keeps the list their results
describe, so /v1/models, /v1/adapters and every request's adapter check read it without asking
the worker (the event loop never waits for the MLX thread to answer a list).

An adapter unmounted while rows use it leaves the list at once (new requests can no longer name
it) though the worker keeps its weights until those rows close; admission bills the listed
adapters' bytes (`on_change`), not the leaving ones: a short overlap, bounded by the rows
already admitted. Until then the worker still holds the id: mounting it again from the same path
(weights unchanged) keeps it, cancelling the unmount; from anywhere else it is a conflict
(`AdapterDraining`, 409) until those rows finish.

Which adapters a row may stack is checked here too (model/lora/stack.py `stack_problem`, the
engine's own rule), from the kinds the worker reported on mount, so a request naming a stack the
engine cannot run is the route's 400.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from actors.policy import AdmissionCeiling, admission_ceiling
from actors.startup import StartupFailed
from actors.worker_api import AdapterNotMounted, AdapterReport, ModelInfo
from model.engine.rows import RowSpec
from model.lora.stack import stack_problem

if TYPE_CHECKING:  # MLX: only ever on the worker's thread
    from model.engine.engine import Engine


class MountsAdapters(Protocol):
    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport: ...

    async def unmount_adapter(self, adapter_id: str) -> bool: ...


class AdapterConflict(ValueError):
    """The id is already mounted (409)."""


class AdapterDraining(AdapterConflict):
    """The id was unmounted but rows still use it, and the mount names other weights (409)."""


class AdapterNotStackable(AdapterNotMounted):
    """A row stacks adapters the engine cannot run together (the scheduler answers any
    `AdapterNotMounted` as that request's 400, as for an adapter unmounted after the route's check)."""


class AdapterMissing(KeyError):
    """The id is not mounted (404)."""


class AdapterRegistry:
    def __init__(self, worker: MountsAdapters | None = None) -> None:
        self._worker = worker
        self._mounted: dict[str, AdapterReport] = {}
        self._lock = trio.Lock()  # one mount / unmount at a time: the "already mounted" check holds
        # Told the listed adapters' total bytes after each change (the handles re-bill admission).
        self.on_change: Callable[[int], None] = lambda nbytes: None

    def infos(self) -> list[AdapterReport]:
        return list(self._mounted.values())

    def get(self, adapter_id: str) -> AdapterReport | None:
        return self._mounted.get(adapter_id)

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._mounted

    @property
    def nbytes(self) -> int:
        return sum(report.nbytes for report in self._mounted.values())

    async def mount(self, adapter_id: str, path: str) -> AdapterReport:
        """Mount on the worker. `AdapterConflict` if the id is mounted, `AdapterDraining` if it is
        still leaving (model/lora/adapters.py); ValueError: the engine's reason it cannot (not found,
        shapes that do not fit, a full fine-tune, ...)."""
        async with self._lock:
            if adapter_id in self._mounted:
                raise AdapterConflict(f"adapter {adapter_id!r} is already mounted")
            try:
                report = await self._require_worker().mount_adapter(adapter_id, path)
            except ValueError as exc:
                if getattr(exc, "status", None) == 409:  # (model/lora/adapters.py AdapterStillLeaving)
                    raise AdapterDraining(str(exc)) from exc
                raise
            self._mounted[adapter_id] = report
            self.on_change(self.nbytes)
            return report

    async def unmount(self, adapter_id: str) -> bool:
        """True: gone now; False: the worker drops it once the rows using it close.
        `AdapterMissing` if the id is not mounted."""
        async with self._lock:
            if adapter_id not in self._mounted:
                raise AdapterMissing(adapter_id)
            gone = await self._require_worker().unmount_adapter(adapter_id)
            del self._mounted[adapter_id]
            self.on_change(self.nbytes)
            return gone

    def _require_worker(self) -> MountsAdapters:
        if self._worker is None:
            raise ValueError("this server cannot mount adapters")
        return self._worker


async def mount_flag_adapters(registry: AdapterRegistry, adapters: Sequence[tuple[str, str]]) -> None:
    """`--adapter ID=PATH`, in order, once the model is loaded. One that cannot mount is a
    usage error: `StartupFailed` (exit 2) naming the flag and the engine's reason."""
    for adapter_id, path in adapters:
        try:
            await registry.mount(adapter_id, path)
        except ValueError as exc:
            raise StartupFailed(f"--adapter {adapter_id}={path}: {exc}", usage=True) from exc


def ceiling_with_adapters(ceiling: AdmissionCeiling, info: ModelInfo, adapter_bytes: int) -> AdmissionCeiling:
    """`ceiling` re-computed with `adapter_bytes` of mounted adapters out of the budget."""
    return admission_ceiling(
        budget_bytes=ceiling.memory_budget_bytes,
        weights_bytes=ceiling.weights_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        context_length=info.context_length,
        transient_bytes=ceiling.transient_bytes,
        kv_quant_ratio=info.kv_quant_ratio,
        kv_quantized_from=info.kv_quantized_from,
        adapter_bytes=adapter_bytes,
        state_bytes_per_row=info.state_bytes_per_row,
        kv_budget_bytes=ceiling.kv_budget_bytes,
        other_weights_bytes=ceiling.other_weights_bytes,
    )


def mounted_for(engine: Engine, spec: RowSpec) -> RowSpec:
    """On the MLX thread, before a row opens: `spec` once every adapter it names is mounted and
    they can be stacked, else `AdapterNotMounted` (unmounted, or remounted as another kind, after
    the route's check: that request's 400, no worker failure)."""
    if spec.adapters:
        mounted = {info.id: info for info in engine.adapters.infos()}
        missing = [a for a in spec.adapters if a not in mounted]
        if missing:
            raise AdapterNotMounted(f"adapter {missing[0]!r} is not mounted")
        if problem := stack_problem([mounted[a] for a in spec.adapters]):
            raise AdapterNotStackable(problem)
    return spec
