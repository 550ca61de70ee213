"""The shutdown flush's verdict: an entry the SSD size cap evicted is gone as configured, not lost.

A small --ssd-cache-max evicts an entry from disk; when RAM has replaced it too, the flush used
to count it "missing" and the process exited 1. The store now remembers its cap evictions
(`SsdStore.evicted_by_cap`), and durability settles such a record as "evicted": durable.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

from actors.ssd.durability import Durability
from actors.ssd.spill_queue import SpillQueue
from cache.ssd_identity import Identity
from cache.ssd_index import IndexEntry
from cache.ssd_store import SsdStore
from tests.helpers.ssd_fakes import FakePort, FakeStore

A = tuple(range(10, 20))
B = tuple(range(30, 40))


def entry(root: Path, tokens: tuple[int, ...], *, mtime: float, trimmable: bool = True) -> IndexEntry:
    return IndexEntry(
        path=root / f"{uuid.uuid4().hex}.mlxkv",
        namespace="",
        ids=np.asarray(tokens, dtype=np.int64),
        nbytes=100,
        mtime=mtime,
        trimmable=trimmable,
    )


def test_the_store_remembers_what_its_cap_evicted(tmp_path):
    store = SsdStore(tmp_path, Identity("m", "f", "f32", "t"), max_bytes=150)  # room for one entry
    store._committed(entry(tmp_path, A + (1, 2), mtime=1.0))  # what a writer's commit calls
    store._committed(entry(tmp_path, B, mtime=2.0))  # evicts the older one
    assert store.stats.evicted == 1 and not store.has_durable_prefix(A, "")
    assert store.evicted_by_cap(A + (1, 2), "")  # the exact entry
    assert store.evicted_by_cap(A, "")  # a prefix it served (trimmable)
    assert not store.evicted_by_cap(B, "")  # still on disk
    assert not store.evicted_by_cap(A + (1, 2, 3), "")  # longer than anything it held
    assert not store.evicted_by_cap(A, "other-namespace")


@asynccontextmanager
async def tier(evicted: set[tuple[str, tuple[int, ...]]]):
    store = FakeStore()
    port = FakePort(store)
    spills = SpillQueue(store, cap_bytes=10**6, idle=lambda: True, run_blocking=store.run_blocking)
    durability = Durability(
        port, spills, busy=lambda: False, evicted_by_cap=lambda tokens, ns: (ns, tuple(tokens)) in evicted
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(spills.run)
        await nursery.start(durability.run)
        yield store, port, durability
        nursery.cancel_scope.cancel()


async def replaced_and_evicted(store: FakeStore, port: FakePort, durability: Durability) -> None:
    """A was written, then re-put (dirty again); RAM replaced it and the cap evicted its file."""
    port.put(A)
    durability.mark("", A)
    assert (await durability.flush()).durable and store.commits()
    durability.mark("", A)
    del port.ram[("", A)]
    del store.files[("", A)]


async def test_an_entry_the_cap_evicted_after_ram_replaced_it_is_durable(autojump_clock):
    evicted = {("", A)}
    async with tier(evicted) as (store, port, durability):
        await replaced_and_evicted(store, port, durability)
        result = await durability.flush()
    assert result.durable and result.missing_snapshots == 0 and result.pending_snapshots == 0
    assert durability.counters.evicted == 1 and durability.counters.missing == 0


async def test_an_entry_lost_without_a_cap_eviction_is_still_not_durable(autojump_clock):
    async with tier(set()) as (store, port, durability):
        await replaced_and_evicted(store, port, durability)  # gone from disk, but not by the cap
        result = await durability.flush()
    assert not result.durable and result.missing_snapshots == 1
