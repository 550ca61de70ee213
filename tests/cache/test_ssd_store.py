"""The SSD store and the tiered take, with a real tiny engine: file format, atomic layout,
start-up scan, identity, tiering rules, caps, and restored output equal to a cold run."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from cache.spill_item import LayerMeta
from cache.ssd_format import namespace_dirname
from cache.ssd_identity import model_fingerprint, scheme_key
from cache.ssd_store import QUARANTINE, SsdUnavailable
from cache.tiered import TieredPromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from tests.engine_helpers import generate_tokens
from tests.helpers.ssd_store import (
    PROMPT,
    RNG,
    cold,
    identity_of,
    open_store,
    run,
    store_prompt,
    tiered_engine,
    write_item,
)


@pytest.fixture(scope="module")
def loaded(qwen3_dir):
    return load_model(qwen3_dir)


def test_restart_restores_from_disk_and_output_equals_cold(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    tokens, first = store_prompt(loaded, store)
    store.close()
    store = open_store(tmp_path, loaded)  # a new process: empty RAM, index from the scan
    assert len(store) == 1 and store.longest_durable_prefix_tokens == len(tokens)
    engine, cache = tiered_engine(loaded, store)
    turn2 = PROMPT + tuple(first) + (5, 6, 7, 8)
    cached, out = run(engine, turn2)
    assert cached == len(tokens) and cache.restores == 1 and store.stats.restores == 1
    assert out == cold(loaded, turn2)


def test_bf16_kv_round_trips(tiny_model_factory, tmp_path):
    lm = load_model(tiny_model_factory("qwen3", dtype="bfloat16"))
    assert scheme_key(str(lm.kv_dtype).rsplit(".", 1)[-1]) == "bf16"
    store = open_store(tmp_path, lm)
    tokens, first = store_prompt(lm, store)
    store.close()
    store = open_store(tmp_path, lm)
    engine, cache = tiered_engine(lm, store)
    turn2 = PROMPT + tuple(first) + (5, 6, 7)
    cached, out = run(engine, turn2)
    assert cached == len(tokens) and out == cold(lm, turn2)


def test_file_is_safetensors_with_a_verified_header(loaded, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    store = open_store(tmp_path, loaded)
    tokens, _ = store_prompt(loaded, store)
    path = store.entries()[0].path
    assert path.parent == store.dir / "base" and path.suffix == ".mlxkv"
    assert store.dir.parent == tmp_path and store.dir.name == identity_of(loaded).dirname
    tensors = safetensors_numpy.load_file(str(path))
    n_layers = len(loaded.model.layers)
    assert sorted(tensors) == sorted(f"l{i}.{kv}" for i in range(n_layers) for kv in ("keys", "values"))
    assert all(t.shape[2] == len(tokens) for t in tensors.values())
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 4096 == 0  # tensor data is page-aligned
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    header = json.loads(meta["header"])
    assert header["tokens"] == list(tokens) and header["namespace"] == ""
    assert header["fingerprint"] == identity_of(loaded).fingerprint and len(meta["header_hash"]) == 64
    assert [layer["offset"] for layer in header["layers"]] == [len(tokens)] * n_layers
    assert all(len(t["hash"]) == 64 and t["hash"] != "0" * 64 for t in header["tensors"].values())


def test_scan_reaps_temp_orphans_and_ignores_other_identities(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    store_prompt(loaded, store)
    store.close()
    orphan = store.dir / "base" / ".deadbeef.mlxkv.tmp"
    orphan.write_bytes(b"half a file")
    other = tmp_path / "0123456789abcdef-bf16-000000000000" / "base"
    other.mkdir(parents=True)
    (other / "x.mlxkv").write_bytes(b"another model's entry")
    (other / ".y.mlxkv.tmp").write_bytes(b"another server's temp file")
    store = open_store(tmp_path, loaded)
    assert not orphan.exists() and store.stats.reaped_temp == 1 and len(store) == 1
    assert (other / "x.mlxkv").exists() and (other / ".y.mlxkv.tmp").exists()  # never touched


def test_mismatched_files_in_our_directory_are_quarantined(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    store_prompt(loaded, store)
    store.close()
    good = next((store.dir / "base").glob("*.mlxkv"))
    wrong_ns = store.dir / namespace_dirname("adapter") / good.name
    wrong_ns.parent.mkdir()
    wrong_ns.write_bytes(good.read_bytes())  # a base-namespace header in an adapter's directory
    (store.dir / "base" / "junk.mlxkv").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    store = open_store(tmp_path, loaded)
    assert len(store) == 1 and store.stats.quarantined == 2
    assert not wrong_ns.exists() and len(list((store.dir / QUARANTINE).iterdir())) == 2


def test_a_second_server_cannot_open_the_same_directory(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    with pytest.raises(SsdUnavailable, match="in use"):
        open_store(tmp_path, loaded)
    store.close()
    open_store(tmp_path, loaded).close()


def test_fingerprint_covers_the_weights_not_just_the_config(tiny_model_factory):
    a, b = tiny_model_factory("qwen3", seed=1), tiny_model_factory("qwen3", seed=2)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a)


def test_ssd_wins_only_with_a_strictly_longer_prefix(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    engine, cache = tiered_engine(loaded, store)
    first = generate_tokens(engine, [RowSpec(1, PROMPT, SamplingParams(), 6)], reusable=True)[1]
    ((ns, tokens),) = cache.keys()
    assert write_item(store, cache.snapshot(tokens, ns))
    # The same entry in RAM and on disk: equal usable prefixes → the RAM tier serves, no disk read.
    turn2 = PROMPT + tuple(first) + (5, 6)
    cached, out = run(engine, turn2)
    assert cached == len(tokens) and cache.restores == 0 and cache.hits == 1
    # A fresh RAM tier holding only a shorter entry: the SSD's longer prefix wins.
    engine, cache = tiered_engine(loaded, store)
    generate_tokens(engine, [RowSpec(1, PROMPT[:100], SamplingParams(), 1)], reusable=True)
    before = cache.restores
    cached, out2 = run(engine, turn2)
    assert cached == len(tokens) and cache.restores == before + 1 and out2 == out == cold(loaded, turn2)


def test_a_trimmed_restore_serves_a_shorter_prompt(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    store_prompt(loaded, store)
    engine, cache = tiered_engine(loaded, store)
    shorter = PROMPT[:150] + (9, 9, 9)
    cached, out = run(engine, shorter)
    assert cached == 150 and cache.restores == 1 and out == cold(loaded, shorter)


def test_untrimmable_entries_are_used_only_at_their_exact_length(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    engine, cache = tiered_engine(loaded, store)
    generate_tokens(engine, [RowSpec(1, PROMPT, SamplingParams(), 1)], reusable=True)
    ((ns, tokens),) = cache.keys()
    item = cache.snapshot(tokens, ns)
    item.layers = [LayerMeta(layer.kind, layer.offset, False, layer.tensors) for layer in item.layers]
    assert write_item(store, item)
    engine, cache = tiered_engine(loaded, store)
    cached, _ = run(engine, PROMPT[:150] + (1, 2))  # would need a trim: never a candidate
    assert cached == 0 and cache.restores == 0
    longer = tuple(tokens) + (3, 4)
    cached, out = run(engine, longer)  # exact length fits
    assert cached == len(tokens) and cache.restores == 1 and out == cold(loaded, longer)


def test_short_matches_are_not_worth_a_disk_read(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    store_prompt(loaded, store)
    engine, cache = tiered_engine(loaded, store, min_restore_tokens=64)
    cached, _ = run(engine, PROMPT[:40] + (1, 2, 3))
    assert cached == 0 and cache.restores == 0


def test_store_replaces_duplicates_supersedes_ancestors_and_evicts_oldest(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    engine, cache = tiered_engine(loaded, store)
    generate_tokens(engine, [RowSpec(1, PROMPT[:80], SamplingParams(), 1)], reusable=True)
    short = cache.keys()[-1]
    assert write_item(store, cache.snapshot(short[1], short[0]))
    assert write_item(store, cache.snapshot(short[1], short[0]))  # exact duplicate: replaced
    assert len(store) == 1 and len(list((store.dir / "base").glob("*.mlxkv"))) == 1
    generate_tokens(engine, [RowSpec(2, PROMPT, SamplingParams(), 1)], reusable=True)
    long = next(k for k in cache.keys() if len(k[1]) > 100)
    assert write_item(store, cache.snapshot(long[1], long[0]))  # a trimmable descendant
    assert [e.length for e in store.entries()] == [len(long[1])] and store.has_durable_prefix(short[1], "")
    # Cap: room for about one entry; the older one is evicted to make room.
    size = store.entries()[0].nbytes
    store.max_bytes = size + size // 2
    other = tuple(int(x) for x in RNG.integers(1, 400, 200))
    generate_tokens(engine, [RowSpec(3, other, SamplingParams(), 1)], reusable=True)
    new = next(k for k in cache.keys() if k[1][:5] == other[:5])
    assert write_item(store, cache.snapshot(new[1], new[0]))
    assert [e.ids[:5].tolist() for e in store.entries()] == [list(other[:5])]
    assert store.stats.evicted == 1 and store.nbytes <= store.max_bytes
    # Refused outright when one entry exceeds the cap.
    store.max_bytes = 10
    assert store.begin(cache.snapshot(new[1], new[0])) is None and store.stats.refused == 1


def test_namespaces_never_seed_each_other(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    store_prompt(loaded, store, namespace="adapter-a")
    assert (store.dir / namespace_dirname("adapter-a")).is_dir()
    engine, cache = tiered_engine(loaded, store)
    cached, _ = run(engine, PROMPT + (1, 2))
    assert cached == 0 and cache.restores == 0


def test_demote_idle_frees_ram_and_returns_what_the_ssd_lacks(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    now = [0.0]
    engine, cache = tiered_engine(loaded, store, clock=lambda: now[0])
    generate_tokens(engine, [RowSpec(1, PROMPT, SamplingParams(), 1)], reusable=True)
    now[0] = 10.0
    other = tuple(int(x) for x in RNG.integers(1, 400, 120))
    generate_tokens(engine, [RowSpec(2, other, SamplingParams(), 1)], reusable=True)
    now[0] = 65.0
    items = cache.demote_idle(60)  # only the first entry is 60 s idle
    assert [len(i.tokens) for i in items] == [len(PROMPT)] and len(cache) == 1
    assert cache.demotions == 1
    assert write_item(store, items[0])
    now[0] = 200.0
    assert cache.demote_idle(60) != [] and len(cache) == 0


def test_a_failed_restore_is_a_miss_and_the_ram_candidate_serves(loaded, tmp_path):
    store = open_store(tmp_path, loaded)
    engine, cache = tiered_engine(loaded, store)
    generate_tokens(engine, [RowSpec(1, PROMPT[:100], SamplingParams(), 1)], reusable=True)  # RAM: 100
    tokens, first = store_prompt(loaded, store)  # disk: a longer entry
    os.truncate(store.entries()[0].path, 5000)  # damaged behind the index's back
    turn2 = PROMPT + tuple(first) + (5,)
    cached, out = run(engine, turn2)
    assert cached == 100 and cache.restores == 0 and cache.restore_misses == 1
    assert len(store) == 0 and store.stats.quarantined == 1
    assert out == cold(loaded, turn2)


def test_snapshot_views_never_change_under_later_cache_writes():
    import mlx.core as mx

    from cache.tiered import spill_item
    from model.kv.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.random.normal((1, 2, 10, 4)), mx.random.normal((1, 2, 10, 4)))
    mx.eval(cache.keys, cache.values)
    item = spill_item("", tuple(range(10)), [cache])
    before = [t.data.copy() for t in item.tensors]
    clone = cache.clone()  # a RAM hit that diverges after 5 tokens
    clone.trim(5)
    clone.update_and_fetch(mx.ones((1, 2, 300, 4)), mx.ones((1, 2, 300, 4)))
    cache.trim(3)  # and the donor itself written in place
    cache.update_and_fetch(mx.ones((1, 2, 7, 4)) * 5, mx.ones((1, 2, 7, 4)) * 5)
    mx.eval(clone.keys, cache.keys, cache.values)
    assert all(np.array_equal(b, t.data) for b, t in zip(before, item.tensors))
    assert spill_item("", tuple(range(9)), [cache]) is None  # coverage must equal the key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("direct", [True, False])
def test_restored_kv_is_bit_identical_whether_read_into_mlx_memory_or_copied(
    tiny_model_factory, tmp_path, monkeypatch, dtype, direct
):
    """The restore reads straight into MLX arrays when the buffer protocol aliases their memory
    (the fast path), else into numpy buffers that are then copied: same bits either way."""
    import mlx.core as mx

    import cache.tiered as tiered

    lm = load_model(tiny_model_factory("qwen3", dtype=dtype))
    store = open_store(tmp_path, lm)
    tokens, _ = store_prompt(lm, store)
    truth = TieredPromptCache(1 << 30, None)  # the same run's KV, kept in RAM only
    generate_tokens(
        Engine(lm.model, eos_token_ids=[], prompt_cache=truth), [RowSpec(1, PROMPT, SamplingParams(), 6)], reusable=True
    )
    expected, n = truth.take(list(tokens) + [3])
    assert n == len(tokens)
    store.close()

    if not direct:
        monkeypatch.setattr(tiered, "_views_alias", lambda: False)
    used = []
    real_call = tiered._DirectImport.__call__
    monkeypatch.setattr(
        tiered._DirectImport, "__call__", lambda self, specs: used.append(r := real_call(self, specs)) or r
    )
    store = open_store(tmp_path, lm)
    restored, n = TieredPromptCache(1 << 30, store).take(list(tokens) + [3])
    assert n == len(tokens) and restored is not None
    assert (used[0] is not None) == direct
    for got, want in zip(restored, expected):
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert a.dtype == b.dtype
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()
