"""The engine's mounted LoRA adapters: ids, the rows using each, and per-forward selection.

Adapters mount and unmount at runtime (`mount`, `unmount`, on the MLX thread). Rows name the
adapters they stack by id (`RowSpec.adapters`); `open` turns ids into the indices model/lora/mount.py
selects by and counts the row as a user, so an adapter unmounted while rows use it stays until
the last of them closes (`close`); mounting the same id from the same path (weights unchanged)
meanwhile keeps it instead, and from anywhere else is refused (`AdapterStillLeaving`) until they
close, since rows name adapters by id. `select` tells the wrappers which adapters each row of the
next forward uses. Prompt-cache entries are namespaced by the adapters and a fingerprint of
their weights (`namespace`), so KV computed under one adapter set never serves another, after a
restart or a remount under the same id included.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs

from model.lora import mount as lora
from model.lora.ids import adapter_id_problem
from model.lora.stack import stack_problem
from model.nn.language_model import LanguageModel

FINGERPRINT_BYTES = 1 << 20  # of the weights file hashed (with its size): cheap, and enough


@attrs.frozen
class AdapterInfo:
    id: str
    path: str
    fine_tune_type: str
    rank: int
    nbytes: int
    fingerprint: str


class AdapterStillLeaving(ValueError):
    """Mounting an id that is unmounted but still used by rows, with other weights."""

    status = 409  # the trio side's conflict (actors/adapter_registry.py), not a bad request


def _fingerprint(path: Path) -> str:
    weights = path / "adapters.safetensors"
    h = hashlib.sha256(str(weights.stat().st_size).encode())
    with open(weights, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, weights.stat().st_size - FINGERPRINT_BYTES))
        h.update(f.read())
    return h.hexdigest()[:16]


class AdapterSet:
    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self._mounted: dict[str, tuple[int, AdapterInfo]] = {}
        self._users: Counter[str] = Counter()
        self._leaving: set[str] = set()  # unmounted, still used by open rows

    @property
    def installed(self) -> bool:
        return lora.installed(self.model) is not None

    def infos(self) -> list[AdapterInfo]:
        return [info for aid, (_, info) in self._mounted.items() if aid not in self._leaving]

    def mount(self, adapter_id: str, path: str) -> AdapterInfo:
        """Load and mount an adapter (ValueError: a clear reason it cannot be)."""
        if problem := adapter_id_problem(adapter_id):
            raise ValueError(problem)
        if adapter_id in self._leaving:
            return self._keep(adapter_id, path)
        if adapter_id in self._mounted:
            raise ValueError(f"adapter {adapter_id!r} is already mounted")
        adapter = lora.load_adapter(path, self.model, adapter_id)
        info = AdapterInfo(
            adapter_id, str(path), adapter.fine_tune_type, adapter.rank, adapter.nbytes, _fingerprint(Path(path))
        )
        self._mounted[adapter_id] = (lora.mount(self.model, adapter), info)
        return info

    def _keep(self, adapter_id: str, path: str) -> AdapterInfo:
        """A leaving adapter mounted again: kept when `path` holds the weights it was loaded from."""
        info = self._mounted[adapter_id][1]
        same_path = Path(path).resolve() == Path(info.path).resolve()
        try:
            same = same_path and _fingerprint(Path(path)) == info.fingerprint
        except OSError:
            same = False
        if not same:
            keep = f"its weights at {info.path} changed" if same_path else f"or now from {info.path} to keep it"
            raise AdapterStillLeaving(
                f"adapter {adapter_id!r} is still unmounting: {self._users[adapter_id]} running request(s) use it; "
                f"mount it again once they finish ({keep})"
            )
        self._leaving.discard(adapter_id)
        return info

    def unmount(self, adapter_id: str) -> bool:
        """Unmount now (True), or once the rows using it close (False); ValueError if not mounted."""
        if adapter_id not in self._mounted or adapter_id in self._leaving:
            raise ValueError(f"adapter {adapter_id!r} is not mounted")
        if self._users[adapter_id]:
            self._leaving.add(adapter_id)
            return False
        self._drop(adapter_id)
        return True

    def _drop(self, adapter_id: str) -> None:
        lora.select(self.model, [])  # (a stale selection may still name it)
        lora.unmount(self.model, adapter_id)
        del self._mounted[adapter_id]
        self._leaving.discard(adapter_id)
        if not self._mounted:
            lora.uninstall(self.model)  # the base model's own modules (and fast paths) again

    def open(self, adapter_ids: Sequence[str]) -> tuple[int, ...]:
        """A row's selection for these ids (ValueError: one is not mounted, or they cannot stack)."""
        for aid in adapter_ids:
            if aid not in self._mounted or aid in self._leaving:
                raise ValueError(f"adapter {aid!r} is not mounted")
        if problem := stack_problem([self._mounted[aid][1] for aid in adapter_ids]):
            raise ValueError(problem)  # (before counting users: lora.select would refuse it)
        self._users.update(adapter_ids)
        return tuple(self._mounted[aid][0] for aid in adapter_ids)

    def close(self, adapter_ids: Sequence[str]) -> None:
        self._users.subtract(adapter_ids)
        for aid in adapter_ids:
            if aid in self._leaving and self._users[aid] <= 0:
                self._drop(aid)

    def namespace(self, adapter_ids: Sequence[str], namespace: str) -> str:
        if not adapter_ids:
            return namespace
        key = "+".join(f"{aid}:{self._mounted[aid][1].fingerprint}" for aid in adapter_ids)
        return f"lora={key}|{namespace}" if namespace else f"lora={key}"

    def select(self, selections: Sequence[tuple[int, ...]]) -> None:
        """Which adapters each row of the next forward uses (batch order)."""
        if self.installed:
            lora.select(self.model, selections)

    @property
    def nbytes(self) -> int:
        """The adapters' own arrays plus their packed copies (model/lora/pack.py)."""
        state = lora.installed(self.model)
        packed = state.packing.nbytes if state is not None and state.packing is not None else 0
        return sum(info.nbytes for _, info in self._mounted.values()) + packed
