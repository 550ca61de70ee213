"""Test doubles for the SSD tier's actors: a store whose writes spend virtual
time inline, a worker port, and a FakeWorker with the SSD tier attached.

Everything runs on the trio thread with `await trio.sleep(cost)`, so under `autojump_clock`
every timestamp is exact (while a real thread works, autojump sees no runnable task and fires
the next timer early).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from model.engine.rows import RowSpec
from tests.fakes import FakeWorker


@attrs.define(eq=False)
class FakeItem:
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int = 100
    pieces: int = 2
    released: bool = False

    def release(self) -> None:
        self.released = True


class FakeWriter:
    def __init__(self, store: FakeStore, item: FakeItem) -> None:
        self.store, self.item = store, item
        self.left = item.pieces

    def write_next(self) -> bool:
        if self.left == 0:
            return False
        self.left -= 1
        self.store.log.append((trio.current_time(), "piece", self.item.tokens))
        return True

    def commit(self) -> bool:
        if self.item.tokens in self.store.fail_tokens:
            self.store.log.append((trio.current_time(), "failed", self.item.tokens))
            return False
        self.store.files[(self.item.namespace, self.item.tokens)] = self.item.nbytes
        self.store.log.append((trio.current_time(), "commit", self.item.tokens))
        return True

    def abort(self) -> None:
        self.store.log.append((trio.current_time(), "abort", self.item.tokens))


class FakeStore:
    """SsdStore's writer-side interface; every blocking call costs `call_cost` virtual seconds."""

    def __init__(self, *, call_cost: float = 0.1, max_bytes: int = 10**9) -> None:
        self.call_cost = call_cost
        self.max_bytes = max_bytes
        self.files: dict[tuple[str, tuple[int, ...]], int] = {}
        self.log: list[tuple[float, str, tuple[int, ...]]] = []
        self.fail_tokens: set[tuple[int, ...]] = set()
        self.verify = True
        self.dir = "/fake"
        self.stats = attrs.make_class(
            "Stats", {k: attrs.field(default=0) for k in ("writes", "restore_failures", "quarantined", "reaped_temp")}
        )()

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        await trio.sleep(self.call_cost)
        return fn(*args)

    def begin(self, item: FakeItem) -> FakeWriter | None:
        if item.nbytes > self.max_bytes:
            return None
        return FakeWriter(self, item)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    @property
    def longest_durable_prefix_tokens(self) -> int:
        return max((len(t) for _, t in self.files), default=0)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        tokens = tuple(tokens)
        return any(ns == namespace and t[: len(tokens)] == tokens for ns, t in self.files)

    def commits(self) -> list[tuple[float, tuple[int, ...]]]:
        return [(t, toks) for t, what, toks in self.log if what == "commit"]


class FakePort:
    """The GPU worker as durability / demotion see it: a RAM table of entries."""

    def __init__(self, store: FakeStore, *, snapshot_cost: float = 0.0) -> None:
        self.store = store
        self.snapshot_cost = snapshot_cost
        self.ram: dict[tuple[str, tuple[int, ...]], int] = {}  # key -> nbytes
        self.last_used: dict[tuple[str, tuple[int, ...]], float] = {}
        self.snapshots: list[tuple[float, tuple[int, ...]]] = []
        self.demote_calls: list[float] = []
        self.demotions = 0
        self.restores = 0
        self.restore_ms_last = 0.0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.ram), "bytes": sum(self.ram.values()), "max_bytes": 10**9, "hits": 0, "misses": 0}

    def put(self, tokens: Sequence[int], namespace: str = "", nbytes: int = 100) -> None:
        key = (namespace, tuple(tokens))
        self.ram[key] = nbytes
        self.last_used[key] = trio.current_time()

    async def snapshot(self, tokens: Sequence[int], namespace: str) -> FakeItem | None:
        await trio.sleep(self.snapshot_cost)
        self.snapshots.append((trio.current_time(), tuple(tokens)))
        nbytes = self.ram.get((namespace, tuple(tokens)))
        return None if nbytes is None else FakeItem(namespace, tuple(tokens), nbytes)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        return self.store.has_durable_prefix(tokens, namespace)

    async def demote_idle(self, idle_s: float) -> list[FakeItem]:
        now = trio.current_time()
        self.demote_calls.append(now)
        out = []
        for key, nbytes in list(self.ram.items()):
            if now - self.last_used[key] >= idle_s:
                del self.ram[key]
                self.demotions += 1
                if not self.store.has_durable_prefix(key[1], key[0]):
                    out.append(FakeItem(key[0], key[1], nbytes))
        return out

    async def run_exclusive(self, fn: Any) -> Any:
        return fn(None)


class SsdFakeWorker(FakeWorker):
    """tests.fakes.FakeWorker plus the SSD tier's worker surface: a reusable close puts the
    row's prompt + generated tokens into a fake RAM cache and fires the put listener."""

    def __init__(self, store: FakeStore | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.ssd_store = store if store is not None else FakeStore()
        self.port = FakePort(self.ssd_store)
        self.prompt_cache = self.port  # /stats reads restores / demotions / restore_ms_last
        self.listener: Any = None

    def set_put_listener(self, listener: Any) -> None:
        self.listener = listener

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        row = self.rows.get(row_id)
        await super().close_row(row_id, reusable=reusable, retain_s=retain_s)
        if reusable and row is not None:
            spec: RowSpec = row.spec
            tokens = spec.prompt + tuple(self.expected(spec.prompt, row.generated))
            self.port.put(tokens, spec.namespace)
            if self.listener is not None:
                self.listener(spec.namespace, tokens)

    async def snapshot(self, tokens: Sequence[int], namespace: str) -> FakeItem | None:
        return await self.port.snapshot(tokens, namespace)

    async def demote_idle(self, idle_s: float) -> list[FakeItem]:
        return await self.port.demote_idle(idle_s)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        return self.port.has_durable_prefix(tokens, namespace)

    async def run_exclusive(self, fn: Any) -> Any:
        while self._busy:  # the real worker queues jobs; the fake runs inline, so wait our turn
            await trio.sleep(0)
        async with self._call("run_exclusive", None, 0.0):
            return fn(None)
