"""Retention hints on the SSD tier: an entry a client asked to keep (OpenAI's 24 h
`prompt_cache_retention`, Anthropic's `cache_control`) is written with its deadline, survives a
restart's scan with it, and is evicted only after every unhinted entry until the deadline, within
the retention share of the cap."""

from __future__ import annotations

import time

import numpy as np

from cache.ssd_identity import Identity
from cache.ssd_index import IndexEntry, SsdIndex
from cache.ssd_store import SsdStore
from cache.tiered import TieredPromptCache, spill_item
from tests.helpers.kv import kv
from tests.helpers.ssd_store import write_item

IDENTITY = Identity("m", "f" * 64, "f32", "7" * 64)
DAY_S = 24 * 3600.0


def entry(name: str, mtime: float, retain_until: float | None = None, nbytes: int = 100) -> IndexEntry:
    return IndexEntry(
        path=f"/x/{name}",  # type: ignore[arg-type]
        namespace="",
        ids=np.arange(3, dtype=np.int64) + hash(name) % 1000,
        nbytes=nbytes,
        mtime=mtime,
        trimmable=True,
        retain_until=retain_until,
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_hinted_entry_outlives_newer_unhinted_ones_until_its_deadline():
    clock = Clock()
    index = SsdIndex(clock=clock)
    index.load([entry("hinted", mtime=1.0, retain_until=clock.t + DAY_S)], max_bytes=1000)
    for i in range(5):  # newer, unhinted: the cap holds three entries
        index.add(entry(f"plain{i}", mtime=10.0 + i), max_bytes=300)
    names = sorted(str(e.path).rsplit("/", 1)[1] for e in index.entries())
    assert names == ["hinted", "plain3", "plain4"]
    clock.t += DAY_S + 1  # past its deadline: the oldest file, and the first to go
    index.add(entry("plain5", mtime=20.0), max_bytes=300)
    assert "hinted" not in {str(e.path).rsplit("/", 1)[1] for e in index.entries()}


def test_protection_is_capped_at_the_share_the_earliest_deadline_losing_it_first():
    clock = Clock()
    index = SsdIndex(clock=clock, retention_share=0.5)  # 200 of a 400-byte cap: two entries
    hinted = [entry(f"h{i}", mtime=float(i), retain_until=clock.t + 100 + i) for i in range(3)]
    index.load(hinted, max_bytes=1000)
    index.add(entry("plain", mtime=50.0), max_bytes=300)
    assert sorted(str(e.path).rsplit("/", 1)[1] for e in index.entries()) == ["h1", "h2", "plain"]


def test_the_deadline_is_written_read_back_at_start_and_kept_by_eviction(tmp_path):
    clock = Clock()
    cache = TieredPromptCache(1 << 20, None, clock=clock)
    hinted, plain = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.put(hinted, kv(hinted), retain_s=DAY_S)
    cache.put(plain, kv(plain))
    clock.t += 3600.0
    item = cache.snapshot(hinted)
    assert item is not None and item.retain_until is not None
    assert abs(item.retain_until - (time.time() + DAY_S - 3600.0)) < 60
    assert cache.snapshot(plain).retain_until is None

    store = SsdStore(tmp_path, IDENTITY, max_bytes=1 << 20).open()
    assert write_item(store, item) and write_item(store, cache.snapshot(plain))
    store.close()
    reopened = SsdStore(tmp_path, IDENTITY, max_bytes=1 << 20).open()
    by_tokens = {tuple(e.ids.tolist()): e for e in reopened.entries()}
    assert by_tokens[tuple(hinted)].retain_until == item.retain_until
    assert by_tokens[tuple(plain)].retain_until is None
    # A newer unhinted entry that overflows the cap evicts the plain one, not the hinted one.
    reopened.max_bytes = 2 * by_tokens[tuple(plain)].nbytes + 10
    newer = [9, 10, 11, 12]
    assert write_item(reopened, spill_item("", newer, kv(newer)))
    assert {tuple(e.ids.tolist()) for e in reopened.entries()} == {tuple(hinted), tuple(newer)}
    reopened.close()
