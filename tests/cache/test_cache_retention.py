"""Retention hints in the RAM prompt cache: an entry put with `retain_s` outlives LRU pressure until
its deadline (on an injected clock), within the share of the cap; the SSD demotion sweep takes
hinted entries first and leaves protected ones in RAM."""

from __future__ import annotations

import trio.testing

from api.cache_hints import RETENTION_24H_S
from cache.prompt_cache import PromptCache
from cache.tiered import TieredPromptCache
from tests.helpers.kv import BYTES_PER_TOKEN, kv


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def entry(first: int, n: int = 3) -> list[int]:
    return list(range(first, first + n))


def filled(pc: PromptCache, firsts: list[int]) -> None:
    for first in firsts:
        pc.put(entry(first), kv(entry(first)))


def test_a_hinted_prefix_survives_lru_pressure_until_its_ttl_then_is_evicted_like_any_other():
    clock = Clock()
    pc = PromptCache(4 * 3 * BYTES_PER_TOKEN, now=clock)  # four 3-token entries
    hinted = entry(100)
    assert pc.put(hinted, kv(hinted), retain_s=300.0)
    filled(pc, [10, 20, 30, 40, 50, 60])  # twice the cache's room in newer, un-hinted entries
    assert pc.find_exact(hinted) is not None
    assert [pc.find_exact(entry(f)) is not None for f in (10, 20, 30, 40, 50, 60)] == [False] * 3 + [True] * 3
    clock.t = 299.0
    filled(pc, [70])
    assert pc.find_exact(hinted) is not None
    clock.t = 301.0  # past the deadline: the oldest entry is the first to go
    filled(pc, [80])
    assert pc.find_exact(hinted) is None
    assert pc.nbytes <= pc.max_bytes


def test_the_same_entry_without_a_hint_is_evicted_first():
    pc = PromptCache(4 * 3 * BYTES_PER_TOKEN, now=Clock())
    plain = entry(100)
    pc.put(plain, kv(plain))
    filled(pc, [10, 20, 30, 40])
    assert pc.find_exact(plain) is None


def test_a_hit_refreshes_the_deadline_even_through_a_longer_entry():
    clock = Clock()
    pc = PromptCache(4 * 6 * BYTES_PER_TOKEN, now=clock)
    system = entry(100)
    pc.put(system, kv(system), retain_s=300.0)
    turn = system + [7, 8, 9]
    pc.put(turn, kv(turn))  # a longer trimmable entry: the protected ancestor is kept anyway
    assert pc.find_exact(system) is not None and len(pc) == 2
    clock.t = 250.0
    assert pc.take(turn + [1])[1] == 6  # restores through the longer entry, which holds the system prefix
    clock.t = 500.0  # 250 s after the hit: still protected
    filled(pc, [10, 20, 30, 40, 50, 60, 70, 80])
    assert pc.find_exact(system) is not None
    clock.t = 551.0
    filled(pc, [11, 21, 31, 41, 51, 61, 71, 81])
    assert pc.find_exact(system) is None


def test_protection_is_capped_at_the_share_the_earliest_deadlines_losing_it_first():
    clock = Clock()
    pc = PromptCache(10 * 3 * BYTES_PER_TOKEN, retention_share=0.3, now=clock)  # three entries protected
    hinted = [entry(100 + 10 * i) for i in range(4)]
    for i, tokens in enumerate(hinted):
        clock.t = float(i)
        pc.put(tokens, kv(tokens), retain_s=300.0)  # deadlines 300, 301, 302, 303
    assert pc.protected_bytes() == 3 * 3 * BYTES_PER_TOKEN
    filled(pc, [1000 + 10 * i for i in range(20)])  # heavy pressure
    assert pc.find_exact(hinted[0]) is None  # the earliest deadline lost its protection
    assert all(pc.find_exact(t) is not None for t in hinted[1:])
    assert pc.protected_bytes() <= 0.3 * pc.max_bytes


def test_a_share_of_zero_protects_nothing():
    pc = PromptCache(4 * 3 * BYTES_PER_TOKEN, retention_share=0.0, now=Clock())
    hinted = entry(100)
    pc.put(hinted, kv(hinted), retain_s=3600.0)
    filled(pc, [10, 20, 30, 40])
    assert pc.find_exact(hinted) is None


class NoSsd:
    """The SSD store as demotion asks it: it holds nothing yet."""

    def __len__(self) -> int:
        return 0

    def has_exact(self, tokens: tuple[int, ...], namespace: str) -> bool:
        return False


def test_demotion_hands_over_hinted_entries_first_and_keeps_protected_ones_in_ram():
    clock = Clock()
    cache = TieredPromptCache(1 << 20, NoSsd(), clock=clock)  # type: ignore[arg-type]
    plain_old, hinted, plain_new, protected = entry(10), entry(20), entry(30), entry(40)
    cache.put(plain_old, kv(plain_old))
    cache.put(hinted, kv(hinted), retain_s=300.0)
    cache.put(plain_new, kv(plain_new))
    clock.t = 400.0  # every entry idle past 60 s; the hinted one's deadline has passed
    cache.put(protected, kv(protected), retain_s=3600.0)
    clock.t = 500.0
    items = cache.demote_idle(60.0)
    assert [list(i.tokens) for i in items] == [hinted, plain_old, plain_new]
    assert cache.find_exact(protected) is not None and len(cache) == 1
    clock.t = 4100.0  # its deadline passed: it is demoted like any other entry
    assert [list(i.tokens) for i in cache.demote_idle(60.0)] == [protected]


def test_a_24h_retention_prefix_outlives_lru_pressure_that_evicts_an_unhinted_one():
    """OpenAI's `prompt_cache_retention: "24h"` (api/cache_hints.py) puts its prefixes with a
    24 h ttl: they outlive LRU pressure that evicts the same prefix put without a hint."""
    clock = trio.testing.MockClock()
    pc = PromptCache(4 * 3 * BYTES_PER_TOKEN, now=clock.current_time)  # four 3-token entries
    hinted, plain = entry(100), entry(200)
    assert pc.put(hinted, kv(hinted), retain_s=RETENTION_24H_S)
    pc.put(plain, kv(plain))
    clock.jump(RETENTION_24H_S - 60)
    filled(pc, [10, 20, 30, 40, 50])  # more than the cache's room in newer, unhinted entries
    assert pc.find_exact(hinted) is not None and pc.find_exact(plain) is None
    clock.jump(61)  # the day is over: an ordinary entry, the oldest, the first to go
    filled(pc, [60])
    assert pc.find_exact(hinted) is None
