"""PromptCache take/put semantics (ported from mlx-lm's TestLRUPromptCache, plus our rules).

Each fake layer's keys hold the token ids themselves (keys[..., i, 0] == tokens[i]), so a test can
read back exactly which tokens a handed-out cache covers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache.prefix_match import common_prefix_length
from cache.prompt_cache import PromptCache
from model.kv.cache import KVCache
from tests.helpers.kv import BYTES_PER_TOKEN, HEAD_DIM, LAYERS, kv


def grown(tokens, layers=LAYERS):
    """Caches filled the way a forward fills them: a buffer grown in 256-slot steps."""
    caches = []
    for _ in range(layers):
        c = KVCache()
        col = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
        block = mx.broadcast_to(col, (1, 1, len(tokens), HEAD_DIM))
        c.update_and_fetch(block, block)
        caches.append(c)
    return caches


def covered(caches):
    """The token ids a cache list holds, checked identical across layers."""
    seqs = [c.keys[0, 0, : c.offset, 0].tolist() if c.offset else [] for c in caches]
    assert all(s == seqs[0] for s in seqs)
    return [int(t) for t in seqs[0]]


class Untrimmable(KVCache):
    def is_trimmable(self) -> bool:
        return False


def test_prefix_fetch_returns_the_stored_kv_and_leaves_the_suffix():
    pc = PromptCache(1 << 20)
    assert pc.put([1, 2, 3], kv([1, 2, 3]))
    caches, n = pc.take([1, 2, 3, 4, 5])
    assert n == 3 and covered(caches) == [1, 2, 3]
    assert pc.stats()["hits"] == 1


def test_exact_repeat_is_capped_so_one_token_is_forwarded():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4], kv([1, 2, 3, 4]))
    caches, n = pc.take([1, 2, 3, 4])
    assert n == 3 and covered(caches) == [1, 2, 3]
    assert all(c.offset == 3 for c in caches)


def test_trimmable_insert_collapses_its_prefix_ancestor():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3], kv([1, 2, 3]))
    pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    assert len(pc) == 1 and pc.nbytes == 5 * BYTES_PER_TOKEN
    assert pc.find_exact([1, 2, 3]) is None
    caches, n = pc.take([1, 2, 3, 9])  # served by trimming the descendant
    assert n == 3 and covered(caches) == [1, 2, 3]


def test_untrimmable_insert_keeps_ancestors_and_is_never_trimmed():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3], kv([1, 2, 3]))
    pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5], cls=Untrimmable))
    assert len(pc) == 2
    caches, n = pc.take([1, 2, 3, 4, 9])  # the longer match would need a trim it cannot do
    assert n == 3 and covered(caches) == [1, 2, 3]
    caches, n = pc.take([1, 2, 3, 4, 5, 6])  # an exact fit needs no trim
    assert n == 5 and covered(caches) == [1, 2, 3, 4, 5]


def test_diverging_prompt_trims_a_clone_and_the_donor_stays_whole():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    for _ in range(2):
        caches, n = pc.take([1, 2, 3, 7, 8])
        assert n == 3 and covered(caches) == [1, 2, 3]
    assert covered(pc.find_exact([1, 2, 3, 4, 5])) == [1, 2, 3, 4, 5]


def test_writing_into_a_taken_clone_does_not_touch_the_donor():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4], kv([1, 2, 3, 4]))
    caches, n = pc.take([1, 2, 9, 9])
    for c in caches:
        block = mx.full((1, 1, 2, HEAD_DIM), 77.0)
        c.update_and_fetch(block, block)
    assert covered(caches) == [1, 2, 77, 77]
    assert covered(pc.find_exact([1, 2, 3, 4])) == [1, 2, 3, 4]


def test_longest_prefix_wins_among_many_entries():
    pc = PromptCache(1 << 30)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1000, 3000).tolist()
    for cut in range(10, 3000, 10):
        pc.put(base[:cut] + [5000 + cut], kv(base[:cut] + [5000 + cut], layers=1))
    assert len(pc) == 299
    # base[:2350] + [x] shares 2345 tokens and trims back; shorter entries share less.
    caches, n = pc.take(base[:2345] + [1, 2])
    assert n == 2345 and covered(caches) == base[:2345]


def test_common_prefix_length_across_window_boundaries():
    a = np.arange(5000)
    for split in (0, 1, 255, 256, 257, 1000, 4999):
        b = a.copy()
        b[split] = -1
        assert common_prefix_length(a, b) == split
    assert common_prefix_length(a, a[:1234]) == 1234


def test_lru_evicts_the_least_recently_used():
    pc = PromptCache(2 * 3 * BYTES_PER_TOKEN)  # room for two 3-token entries
    pc.put([1, 2, 3], kv([1, 2, 3]))
    pc.put([4, 5, 6], kv([4, 5, 6]))
    assert pc.take([1, 2, 3, 0])[1] == 3  # touch [1, 2, 3]
    pc.put([7, 8, 9], kv([7, 8, 9]))
    assert pc.find_exact([4, 5, 6]) is None
    assert pc.find_exact([1, 2, 3]) is not None and pc.find_exact([7, 8, 9]) is not None
    assert pc.nbytes == 6 * BYTES_PER_TOKEN <= pc.max_bytes


def test_byte_accounting_replaces_duplicates_and_refuses_oversized_entries():
    pc = PromptCache(10 * BYTES_PER_TOKEN)
    pc.put([1, 2, 3], kv([1, 2, 3]))
    pc.put([1, 2, 3], kv([1, 2, 3]))
    assert len(pc) == 1 and pc.nbytes == 3 * BYTES_PER_TOKEN
    assert not pc.put(list(range(11)), kv(list(range(11))))
    assert len(pc) == 1 and pc.nbytes == 3 * BYTES_PER_TOKEN
    for start in range(20, 80, 4):
        pc.put([start, start + 1, start + 2, start + 3], kv([start, start + 1, start + 2, start + 3]))
        assert pc.nbytes <= pc.max_bytes
        assert pc.nbytes == sum(len(tokens) for _, tokens in pc.keys()) * BYTES_PER_TOKEN


def test_a_clone_outlives_the_eviction_of_its_donor():
    pc = PromptCache(4 * BYTES_PER_TOKEN)
    pc.put([1, 2, 3, 4], kv([1, 2, 3, 4]))
    caches, n = pc.take([1, 2, 3, 4, 5])
    pc.put([6, 7, 8, 9], kv([6, 7, 8, 9]))  # evicts the donor
    assert pc.find_exact([1, 2, 3, 4]) is None
    assert n == 4 and covered(caches) == [1, 2, 3, 4]


def test_empty_tokens_neither_store_nor_break_the_cache():
    pc = PromptCache(1 << 20)
    assert not pc.put([], kv([]))
    pc.put([1, 2], kv([1, 2]))
    assert not pc.put([], kv([]))
    assert len(pc) == 1
    assert pc.take([]) == (None, 0)
    assert pc.take([1]) == (None, 0)  # nothing may be restored from a 1-token prompt
    assert pc.take([1, 2, 3])[1] == 2


def test_namespaces_never_seed_each_other():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3], kv([1, 2, 3]), "adapter-a")
    assert pc.take([1, 2, 3, 4], "") == (None, 0)
    assert pc.take([1, 2, 3, 4], "adapter-b") == (None, 0)
    assert pc.take([1, 2, 3, 4], "adapter-a")[1] == 3
    pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]), "")  # supersedes only its own namespace
    assert pc.find_exact([1, 2, 3], "adapter-a") is not None


def test_put_refuses_a_key_that_does_not_match_the_kv_coverage():
    pc = PromptCache(1 << 20)
    assert not pc.put([1, 2, 3, 4], kv([1, 2, 3]))
    mixed = kv([1, 2, 3])
    mixed[1].trim(1)
    assert not pc.put([1, 2, 3], mixed)
    assert len(pc) == 0 and pc.nbytes == 0


def test_zero_capacity_disables_the_cache():
    pc = PromptCache(0)
    assert not pc.put([1, 2, 3], kv([1, 2, 3]))
    assert pc.take([1, 2, 3, 4]) == (None, 0)
    assert pc.stats() == {"entries": 0, "bytes": 0, "max_bytes": 0, "capacity_bytes": 0, "hits": 0, "misses": 1}


def test_on_put_hooks_see_each_stored_key_and_cannot_break_a_put():
    pc = PromptCache(1 << 20)
    seen = []

    def broken(ns, tokens):
        raise RuntimeError("durability tier down")

    pc.on_put += [broken, lambda ns, tokens: seen.append((ns, tokens))]
    assert pc.put([1, 2, 3], kv([1, 2, 3]), "x")
    assert not pc.put([4], kv([4, 5]))
    assert seen == [("x", (1, 2, 3))]
    assert len(pc) == 1


def test_stats_count_hits_and_misses():
    pc = PromptCache(1 << 20)
    pc.take([1, 2, 3])
    pc.put([1, 2, 3], kv([1, 2, 3]))
    pc.take([1, 2, 3, 4])
    pc.take([9, 9, 9])
    stats = {"entries": 1, "bytes": 3 * BYTES_PER_TOKEN, "max_bytes": 1 << 20, "capacity_bytes": 1 << 20}
    assert pc.stats() == {**stats, "hits": 1, "misses": 2}


@pytest.mark.parametrize("cut", [1, 2])
def test_a_take_after_trim_reports_the_offset_it_hands_out(cut):
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    prompt = [1, 2, 3, 4, 5][:-cut] + [42]
    caches, n = pc.take(prompt)
    assert all(c.offset == n for c in caches) and n == 5 - cut


def test_bytes_count_the_buffer_held_not_just_the_tokens_covered():
    """A byte cap must bound real memory: a grown buffer's spare slots and a clone's whole
    source buffer (an MLX slice keeps it alive) are charged."""
    pc = PromptCache(1 << 30)
    assert pc.put(list(range(5)), grown(list(range(5))))
    assert pc.nbytes == 256 * BYTES_PER_TOKEN  # the 256-slot buffer, not 5 tokens
    donor = grown(list(range(1000, 1300)))  # a 512-slot buffer (not an extension of the first)
    clones = [c.clone() for c in donor]
    for c in clones:
        c.trim(290)  # covers 10 tokens, still pins the donor's 512 slots
    assert pc.put(list(range(1000, 1010)), clones)
    assert pc.nbytes == (256 + 512) * BYTES_PER_TOKEN
    tight = PromptCache(300 * BYTES_PER_TOKEN)
    assert not tight.put(list(range(300)), grown(list(range(300))))  # 512 slots do not fit


def test_a_prefix_shorter_than_min_tokens_is_a_miss():
    pc = PromptCache(1 << 20)
    assert pc.put([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    caches, n = pc.take([1, 2, 3, 9, 9], min_tokens=4)  # 3 tokens in common: too short
    assert caches is None and n == 0 and pc.misses == 1 and pc.hits == 0
    caches, n = pc.take([1, 2, 3, 9, 9], min_tokens=3)
    assert n == 3 and pc.hits == 1


@pytest.mark.parametrize("held, incoming, capacity", [(300, 1, 512), (300, 300, 768), (512, 1, 768), (0, 5, 256)])
def test_a_cache_grows_to_a_multiple_of_256_whatever_it_held(held, incoming, capacity):
    """A restored or copied cache holds exactly its tokens (300 here); appending to it lands on
    the same 256-multiple capacities a cold sequence uses, which are the ones warm-up met."""
    (c,) = kv(list(range(1, held + 1)), layers=1) if held else [KVCache()]
    new = list(range(1000, 1000 + incoming))
    col = mx.broadcast_to(mx.array(new, dtype=mx.float32)[None, None, :, None], (1, 1, incoming, HEAD_DIM))
    keys, _ = c.update_and_fetch(col, col)
    assert c.keys.shape[2] == capacity
    assert keys[0, 0, :, 0].tolist() == list(range(1, held + 1)) + new


def test_running_rows_take_room_from_the_cache_least_recently_used_first_protected_last():
    entry = 10 * BYTES_PER_TOKEN
    pc = PromptCache(3 * entry + 100)
    a, b, c = list(range(1, 11)), list(range(21, 31)), list(range(41, 51))
    assert pc.put(a, kv(a)) and pc.put(b, kv(b)) and pc.put(c, kv(c), retain_s=60)
    assert pc.yield_to(2 * entry + 50) == entry  # the least recently used goes first
    assert [t for _, t in pc.keys()] == [tuple(b), tuple(c)]
    assert pc.yield_to(entry) == entry  # then the next unprotected one, not the protected one
    assert [t for _, t in pc.keys()] == [tuple(c)]
    assert pc.stats()["capacity_bytes"] == entry
    assert pc.yield_to(0) == entry and len(pc) == 0  # protection gives way last
    pc.yield_to(10 * entry)  # rows left: the cache is its own size again
    assert pc.capacity == pc.max_bytes and pc.put(a, kv(a))
