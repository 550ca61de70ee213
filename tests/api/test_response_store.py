"""The Responses store: TTL, LRU under a byte cap, oversize entries, delete."""

from __future__ import annotations

import json

from api.response_store import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, rid: str, text: str = "x") -> bool:
    return store.put(rid, input=[{"role": "user", "content": text}], output=[], instructions=None, response={"id": rid})


def test_defaults_are_one_hour_and_32_mib():
    assert DEFAULT_TTL_S == 3600 and DEFAULT_MAX_BYTES == 32 * 2**20


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
    size = len(json.dumps([[{"role": "user", "content": "x"}], [], None, {"id": "a"}]).encode())
    store = ResponseStore(max_bytes=size * 3)
    for rid in "abc":
        assert put(store, rid)
    assert store.get("a") is not None  # touch: b is now the oldest
    put(store, "d")
    assert "b" not in store and {"a", "c", "d"} <= {rid for rid in "abcd" if rid in store}
    assert store.bytes <= store.max_bytes


def test_an_entry_over_the_cap_is_not_kept():
    store = ResponseStore(max_bytes=200)
    assert put(store, "small")
    assert not put(store, "huge", "y" * 500)
    assert "huge" not in store and "small" in store


def test_replace_and_delete_keep_the_byte_count_exact():
    store = ResponseStore()
    put(store, "a", "one")
    put(store, "a", "a much longer text")
    assert len(store) == 1
    assert store.get("a").input[0]["content"] == "a much longer text"
    assert store.delete("a") and not store.delete("a")
    assert store.bytes == 0
