"""Quantized KV entries in the SSD tier: a "qkv" layer (packed uint32 + scales + biases for keys
and values, with bits / group size / conversion point in the header) round-trips exactly, mixes
with full-precision layers, trims like them, and a header that does not describe one faithfully
is a miss; a quantized engine restores one after a restart and decodes exactly as a cold run."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import cache.tiered as tiered
from cache.spill_item import QKV, STORAGE_DTYPES
from cache.ssd_format import SsdCorrupt, _header_hash, parse_header
from cache.ssd_identity import Identity
from cache.ssd_store import QUARANTINE, SsdStore
from cache.tiered import TieredPromptCache, spill_item
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.kv.cache import KVCache
from model.kv.quant import QuantizedKVCache
from model.kv.rows import restorable
from model.kv.scheme import LayerQuant, uniform
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens
from tests.helpers.ssd_store import identity_of, write_item

IDENTITY = Identity("tiny", "f" * 64, "f32", "t" * 64)
HEADS, HEAD_DIM = 2, 64
TOKENS = tuple(range(3, 3 + 40))
NAMESPACE = "kv8:abc|"


def open_store(root: Path) -> SsdStore:
    return SsdStore(root, IDENTITY, max_bytes=1 << 30).open()


def full_cache(n: int, seed: int) -> KVCache:
    rng = np.random.default_rng(seed)
    cache = KVCache()
    keys = mx.array(rng.standard_normal((1, HEADS, n, HEAD_DIM)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, HEADS, n, HEAD_DIM)).astype(np.float32))
    cache.update_and_fetch(keys, values)
    return cache


def quantized_cache(n: int, seed: int, quant: LayerQuant, converted_at: int) -> QuantizedKVCache:
    """`converted_at` positions quantized at once, the rest one update at a time (spare slots too)."""
    full = full_cache(n, seed)
    assert full.keys is not None and full.values is not None
    head = KVCache()
    head.update_and_fetch(full.keys[..., :converted_at, :], full.values[..., :converted_at, :])
    q = QuantizedKVCache.from_full(head, quant)
    q.update_and_fetch(full.keys[..., converted_at:n, :], full.values[..., converted_at:n, :])
    assert q.offset == n and q.converted_at == converted_at
    return q


def mixed_caches(n: int = len(TOKENS)) -> list[Any]:
    """A per-layer scheme: 8-bit, full precision, 4-bit group 32."""
    return [
        quantized_cache(n, 1, LayerQuant(8, 64), converted_at=16),
        full_cache(n, 2),
        quantized_cache(n, 3, LayerQuant(4, 32), converted_at=16),
    ]


def stored_root(tmp_path: Path, caches: list[Any] | None = None) -> Path:
    root = tmp_path / "ssd"
    store = open_store(root)
    item = spill_item(NAMESPACE, TOKENS, caches if caches is not None else mixed_caches())
    assert item is not None
    assert write_item(store, item)
    store.close()
    return root


def arrays_of(cache: Any) -> list[np.ndarray]:
    """The stored positions' arrays (a quantized layer's six, a full one's two)."""
    n = cache.offset
    parts = [cache.keys, cache.values] if isinstance(cache, KVCache) else [*cache.keys, *cache.values]
    return [np.asarray(a[..., :n, :]) for a in parts]


def restore(root: Path, prompt: tuple[int, ...]) -> tuple[TieredPromptCache, list[Any] | None, int]:
    store = open_store(root)
    cache = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    caches, usable = cache.take(prompt, NAMESPACE)
    return cache, caches, usable


@pytest.mark.parametrize("direct", [True, False], ids=["direct-import", "copying-import"])
def test_a_mixed_quantized_entry_round_trips_exactly(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.setattr(tiered, "_views_alias", lambda: False)
    original = mixed_caches()
    root = stored_root(tmp_path, original)
    cache, caches, usable = restore(root, TOKENS + (1,))  # a new store over the same directory
    assert caches is not None and usable == len(TOKENS) and cache.restores == 1
    assert [type(c) for c in caches] == [QuantizedKVCache, KVCache, QuantizedKVCache]
    for got, want in zip(caches, original):
        assert got.offset == want.offset == len(TOKENS)
        if isinstance(want, QuantizedKVCache):
            assert (got.quant, got.converted_at) == (want.quant, want.converted_at)
        got_arrays, want_arrays = arrays_of(got), arrays_of(want)
        assert len(got_arrays) == len(want_arrays)
        for g, w in zip(got_arrays, want_arrays):
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
    assert caches[0].keys[0].dtype == mx.uint32
    # Faithful, so the engine's check tells schemes apart: the 8/64 layer is no 4-bit layer.
    at = 16
    assert not restorable(uniform(4, 64, 0, 3), caches, usable, at)


def test_restored_quantized_layers_trim_to_the_match_and_keep_decoding(tmp_path):
    original = mixed_caches()
    root = stored_root(tmp_path, original)
    prompt = TOKENS[:30] + (999, 998)
    _, caches, usable = restore(root, prompt)
    assert caches is not None and usable == 30
    assert all(c.offset == 30 for c in caches)
    q = caches[0]
    assert q.converted_at == 16
    # The next update writes over the trimmed positions, as a cold cache at 30 would.
    step = mx.array(np.ones((1, HEADS, 1, HEAD_DIM), np.float32))
    keys, _ = q.update_and_fetch(step, step)
    ref = original[0].clone()
    ref.trim(len(TOKENS) - 30)
    want, _ = ref.update_and_fetch(step, step)
    assert q.offset == 31 and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(keys, want))


def test_header_records_each_layers_kind_and_quantization(tmp_path):
    root = stored_root(tmp_path)
    (path,) = list(root.rglob("*.mlxkv"))
    with open(path, "rb") as f:
        header = parse_header(f, path.stat().st_size, IDENTITY).header
    layers = header["layers"]
    assert [layer["kind"] for layer in layers] == [QKV, "kv", QKV]
    assert [(layer.get("bits"), layer.get("group_size"), layer.get("converted_at")) for layer in layers] == [
        (8, 64, 16),
        (None, None, None),
        (4, 32, 16),
    ]
    assert set(layers[1]) == {"kind", "offset", "trimmable", "tensors"}  # a kv layer's record is unchanged
    tensors = header["tensors"]
    assert tensors["l0.keys.packed"]["dtype"] == "U32" and tensors["l0.values.scales"]["dtype"] == "F32"
    assert tensors["l0.keys.packed"]["shape"] == [1, HEADS, len(TOKENS), HEAD_DIM * 8 // 32]
    assert tensors["l2.keys.scales"]["shape"] == [1, HEADS, len(TOKENS), HEAD_DIM // 32]
    assert STORAGE_DTYPES["U32"] == np.dtype("<u4")


def rewrite_header(path: Path, edit) -> None:
    """Edit our JSON header and re-hash it (what a careless tool would do): only the content
    checks can catch it."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    table = json.loads(raw[8 : 8 + n])
    meta = table.pop("__metadata__")
    header = json.loads(meta["header"])
    edit(header)
    meta["header"] = json.dumps(header, sort_keys=True, separators=(",", ":"))
    meta["header_hash"] = _header_hash(meta["header"], table)
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    assert len(body) <= n
    path.write_bytes(raw[:8] + body + b" " * (n - len(body)) + raw[8 + n :])


def _drop(field: str):
    def edit(header: dict) -> None:
        del header["layers"][0][field]

    return edit


def _set(field: str, value: Any, layer: int = 0):
    def edit(header: dict) -> None:
        header["layers"][layer][field] = value

    return edit


def _swap_dtypes(header: dict) -> None:
    packed, scales = header["tensors"]["l0.keys.packed"], header["tensors"]["l0.keys.scales"]
    packed["dtype"], scales["dtype"] = scales["dtype"], packed["dtype"]


HEADER_EDITS = {
    "unknown kind": _set("kind", "zz"),
    "a kv layer of six tensors": _set("kind", "kv"),
    "missing bits": _drop("bits"),
    "missing group_size": _drop("group_size"),
    "missing converted_at": _drop("converted_at"),
    "bits as a string": _set("bits", "8"),
    "bits that do not match the packing": _set("bits", 4),
    "converted_at past the key": _set("converted_at", 99),
    "a quantized kind on a kv layer": _set("kind", QKV, layer=1),
    "a kv kind on a quantized layer's tensors": lambda h: h["layers"][0].update(
        kind="kv", tensors=h["layers"][0]["tensors"][:2]
    ),
    "missing tensors": _drop("tensors"),
    "layers not a list": lambda h: h.update(layers={}),
    "tensor table not a dict": lambda h: h.update(tensors=[]),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS.values()), ids=list(HEADER_EDITS))
def test_a_header_that_misdescribes_a_layer_is_corrupt_and_quarantined(tmp_path, edit):
    root = stored_root(tmp_path)
    (path,) = list(root.rglob("*.mlxkv"))
    rewrite_header(path, edit)
    with open(path, "rb") as f, pytest.raises(SsdCorrupt):
        parse_header(f, path.stat().st_size, IDENTITY)
    store = open_store(root)  # the start-up scan: a miss, never an exception
    assert len(store) == 0 and not path.exists()
    assert len(list((store.dir / QUARANTINE).iterdir())) == 1


def test_swapped_tensor_dtypes_are_corrupt(tmp_path):
    root = stored_root(tmp_path)
    (path,) = list(root.rglob("*.mlxkv"))
    rewrite_header(path, _swap_dtypes)
    with open(path, "rb") as f, pytest.raises(SsdCorrupt):
        parse_header(f, path.stat().st_size, IDENTITY)


def test_a_header_edited_after_the_scan_is_a_miss_at_restore(tmp_path):
    root = stored_root(tmp_path)
    (path,) = list(root.rglob("*.mlxkv"))
    store = open_store(root)
    assert len(store) == 1
    rewrite_header(path, _drop("converted_at"))
    cache = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    caches, usable = cache.take(TOKENS + (1,), NAMESPACE)
    assert (caches, usable) == (None, 0) and cache.restore_misses == 1 and len(store) == 0


def test_a_truncated_file_is_a_miss(tmp_path):
    root = stored_root(tmp_path)
    (path,) = list(root.rglob("*.mlxkv"))
    path.write_bytes(path.read_bytes()[:-100])
    store = open_store(root)
    assert len(store) == 0 and not path.exists()


def test_a_quantized_layer_that_does_not_cover_the_key_is_not_spilled():
    caches = mixed_caches()
    caches[2].trim(1)
    assert spill_item(NAMESPACE, TOKENS, caches) is None


# -- the engine: restored after a restart, decoding exactly as a cold run ---------------------------

CHUNK = 16


@pytest.fixture(scope="module")
def lm(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3", hidden_size=128, num_attention_heads=2, num_key_value_heads=1))


def quant_engine(lm, cache: TieredPromptCache | None) -> Engine:
    scheme = uniform(8, 64, 0, len(lm.model.layers))
    return Engine(
        lm.model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(prefill_chunk=CHUNK), kv_scheme=scheme
    )


def test_engine_restores_a_quantized_entry_after_a_restart_and_equals_a_cold_run(lm, tmp_path):
    prompt = tuple(int(x) for x in np.random.default_rng(3).integers(3, 400, 40))
    store = SsdStore(tmp_path, identity_of(lm), max_bytes=1 << 30).open()
    ram = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    first = generate_tokens(quant_engine(lm, ram), [RowSpec(1, prompt, SamplingParams(), 6)], reusable=True)[1]
    ((ns, tokens),) = ram.keys()
    item = ram.snapshot(tokens, ns)
    assert item is not None and {layer.kind for layer in item.layers} == {QKV}
    assert write_item(store, item)
    store.close()

    store = SsdStore(tmp_path, identity_of(lm), max_bytes=1 << 30).open()  # a new process
    assert len(store) == 1
    ram = TieredPromptCache(1 << 30, store, min_restore_tokens=1)
    engine = quant_engine(lm, ram)
    turn2 = (prompt + tuple(first) + tuple(range(5, 5 + 60)))[:60]
    assert turn2[: len(tokens)] == tokens
    opened = engine.open_row(RowSpec(2, turn2, SamplingParams(), 8))
    assert opened.cached_tokens == len(tokens) and ram.restores == 1
    while engine.prefill(2).remaining:
        pass
    out = [engine.join(2).token]
    while len(out) < 8:
        out += [t.token for t in engine.step()]
    engine.close_row(2)
    cold = generate_tokens(quant_engine(lm, None), [RowSpec(9, turn2, SamplingParams(), 8)])[9]
    assert out == cold
