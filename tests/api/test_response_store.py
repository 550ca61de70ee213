"""The Responses store: TTL, LRU under a cap on measured memory, shared strings counted once,
oversize entries, delete, and its /stats block."""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc

from api.responses.store import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, SHARED_MIN_BYTES, ResponseStore, measure
from api.responses.translate import stored_input


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, rid: str, text: str = "x") -> bool:
    return store.put(rid, input=[{"role": "user", "content": text}], output=[], instructions=None, response={"id": rid})


def entry_bytes(rid: str, text: str = "x") -> int:
    own, large = measure([[{"role": "user", "content": text}], [], None, {"id": rid}])
    return own + sum(sys.getsizeof(s) for s in large)


def conversation(seed: int, turns: int = 20) -> str:
    """A Responses input of short messages, as a client sends it."""
    items = [
        {"type": "message", "role": ("user", "assistant")[k % 2], "content": f"turn {seed}-{k}"} for k in range(turns)
    ]
    return json.dumps(items)


def test_defaults_are_one_hour_and_32_mib():
    assert DEFAULT_TTL_S == 3600 and DEFAULT_MAX_BYTES == 32 * 2**20


def test_the_measure_is_what_the_entries_take_in_memory():
    """Against tracemalloc: the measure is within 10%, where the JSON length it replaced saw
    under a third of it."""
    bodies = [conversation(seed) for seed in range(200)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        items = [stored_input(json.loads(body)) for body in bodies]  # what the store keeps of an input
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    measured = sum(own + sum(sys.getsizeof(s) for s in large) for own, large in map(measure, items))
    json_bytes = sum(len(json.dumps(entry).encode()) for entry in items)
    assert 0.9 <= measured / traced <= 1.1, (measured, traced)
    assert traced > 3 * json_bytes, (traced, json_bytes)


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(ttl_s=3600, clock=clock)
    put(store, "a")
    clock.now = 3599.0
    assert store.get("a") is not None  # a read touches LRU order, not the expiry
    clock.now = 3600.0
    assert store.get("a") is None and len(store) == 0 and store.bytes == 0


def test_expiry_is_swept_on_put():
    clock = Clock()
    store = ResponseStore(ttl_s=10, clock=clock)
    put(store, "a")
    clock.now = 11
    put(store, "b")
    assert "a" not in store and "b" in store


def test_byte_cap_evicts_least_recently_used_first():
    store = ResponseStore(max_bytes=sum(entry_bytes(rid) for rid in "abc"))
    for rid in "abc":
        assert put(store, rid)
    assert store.bytes == store.max_bytes
    assert store.get("a") is not None  # touch: b is now the oldest
    put(store, "d")
    assert "b" not in store and {"a", "c", "d"} <= {rid for rid in "abcd" if rid in store}
    assert store.bytes <= store.max_bytes and store.evicted == 1


def test_an_entry_over_the_cap_is_not_kept():
    store = ResponseStore(max_bytes=entry_bytes("small") + 100)
    assert put(store, "small")
    assert not put(store, "huge", "y" * 500)
    assert "huge" not in store and "small" in store and store.refused == 1


def test_replace_and_delete_keep_the_byte_count_exact():
    store = ResponseStore()
    put(store, "a", "one")
    put(store, "a", "a much longer text")
    assert len(store) == 1 and store.bytes == entry_bytes("a", "a much longer text")
    assert store.get("a").input[0]["content"] == "a much longer text"
    assert store.delete("a") and not store.delete("a")
    assert store.bytes == 0


def test_a_string_held_by_several_entries_is_counted_once():
    """A continuation re-holds its predecessors' texts: counting them per entry would fill the
    cap with memory that is not there."""
    text = "z" * (4 * SHARED_MIN_BYTES)
    store = ResponseStore()
    put(store, "a", text)
    put(store, "b", text)
    put(store, "c", "z" * (4 * SHARED_MIN_BYTES))  # equal, but its own object: its own memory
    small = entry_bytes("a", "") - sys.getsizeof("")  # an entry without its text
    assert store.bytes == 3 * small + 2 * sys.getsizeof(text)
    store.delete("a")
    assert store.bytes == 2 * small + 2 * sys.getsizeof(text)  # b still holds it
    store.delete("b")
    store.delete("c")
    assert store.bytes == 0
    # A string shorter than SHARED_MIN_BYTES is counted per entry.
    own, large = measure(["y" * (SHARED_MIN_BYTES - 100)])
    assert large == [] and own > SHARED_MIN_BYTES - 100


def test_stats():
    store = ResponseStore(max_bytes=entry_bytes("a") + 100)
    put(store, "a")
    put(store, "b")  # evicts a
    put(store, "c", "y" * 1000)  # refused
    assert store.stats() == {
        "entries": 1,
        "bytes": entry_bytes("b"),
        "max_bytes": entry_bytes("a") + 100,
        "evicted": 1,
        "refused": 1,
        "ttl_s": DEFAULT_TTL_S,
    }
