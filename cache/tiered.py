"""The prompt cache with an SSD tier under it: what the engine is given when `--ssd-cache` is on.

`TieredPromptCache` is a `PromptCache` (same take / put / find_exact / stats / on_put): the
engine sees either as a `model.kv.cache.PrefixCache`. What it adds, all on the GPU-worker thread:

* `take` tiers: the SSD entry wins only with a strictly longer usable prefix than the best RAM
  entry (and at least `min_restore_tokens`); it is read, verified, turned into owned KV caches
  and trimmed to the match. Any failure quarantines the file and the RAM candidate serves.
* `snapshot(tokens, ns)`: an exact entry as a `SpillItem` — numpy views of its evaluated KV
  buffers (zero-copy; the writer thread reads them, MLX never sees another thread).
* `demote_idle(idle_s)`: entries unused that long leave RAM; the ones not yet on disk come
  back as SpillItems for the spill queue, those put with a retention hint first. An entry still
  protected by its retention deadline stays in RAM.

Restored entries are not put back into RAM: the row that restored one puts its longer KV when it
finishes, which supersedes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from cache.prompt_cache import RETENTION_SHARE, EntryKey, PromptCache
from cache.spill_item import KV, LAYER_TENSORS, QKV, LayerMeta, SpillItem, SpillTensor
from cache.ssd_index import IndexEntry
from cache.ssd_store import SsdStore, TensorSpec
from model.kv.cache import KVCache
from model.kv.quant import QuantizedKVCache
from model.kv.scheme import LayerQuant

log = logging.getLogger(__name__)

# Below this, reading a file costs about what re-prefilling saves (and every chat prompt shares
# its first few template tokens with every stored entry).
MIN_RESTORE_TOKENS = 64

_TAGS = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


def _export(array: mx.array) -> tuple[str, np.ndarray]:
    """(safetensors tag, zero-copy numpy view) of an evaluated array; bf16 as raw uint16 bits,
    a quantized layer's packed uint32 words as they are."""
    tag = _TAGS.get(array.dtype)
    if tag is None:
        raise TypeError(f"unsupported KV dtype {array.dtype}")
    if tag == "BF16":
        array = array.view(mx.uint16)
    mx.eval(array)
    return tag, np.asarray(array)


def _import(data: np.ndarray, tag: str) -> mx.array:
    array = mx.array(data)
    return array.view(mx.bfloat16) if tag == "BF16" else array


_STORAGE = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.uint16, "U32": mx.uint32}  # bf16 lands as its raw bits


class _DirectImport:
    """Destination MLX arrays for a restore, handed to `SsdStore.read` as writable byte views
    (the buffer protocol gives numpy a view of an evaluated array's memory, as `_export` uses
    for the other direction), so the reader threads pread and hash straight into them.

    This skips `_import`'s second pass over the bytes (numpy buffer → MLX copy). Not on CUDA:
    there every MLX buffer is managed memory, and eight threads writing into fresh managed
    pages took 2.6-3.7 s for the 470 MB of a 4k-token 0.6B-shape entry the first time in a
    process on the H200 host (benchmarks/restore_cost.py, zeroed on either stream), where
    `mx.array` copies took 0.2-0.4 s. Any doubt about the views → None, and the read falls
    back to numpy buffers + `_import`."""

    def __init__(self) -> None:
        self.arrays: dict[str, mx.array] = {}

    def __call__(self, specs: list[TensorSpec]) -> dict[str, np.ndarray] | None:
        if not _views_alias():
            return None
        try:
            arrays = {name: mx.zeros(shape, dtype=_STORAGE[tag], stream=mx.cpu) for name, tag, shape in specs}
            mx.eval(list(arrays.values()))
            views = {name: np.asarray(a).reshape(-1).view(np.uint8) for name, a in arrays.items()}
        except (KeyError, TypeError, ValueError):
            return None
        for name in views:
            v = views[name]
            if not v.flags.writeable or v.flags.owndata or v.nbytes != arrays[name].nbytes:
                return None
        self.arrays = {
            name: a.view(mx.bfloat16) if tag == "BF16" else a for (name, tag, _), a in zip(specs, arrays.values())
        }
        return views


_ALIAS_CHECKED: list[bool] = []


def _views_alias() -> bool:
    """Once per process: does a write through np.asarray(array) reach the MLX array itself?"""
    if not _ALIAS_CHECKED:
        if mx.default_device().type == mx.gpu and not mx.metal.is_available():
            _ALIAS_CHECKED.append(False)  # CUDA: see _DirectImport
            return False
        try:
            probe = mx.zeros((4096,), dtype=mx.uint16, stream=mx.cpu)
            mx.eval(probe)
            view = np.asarray(probe)
            view[4095] = 0xBEEF
            _ALIAS_CHECKED.append(view.flags.writeable and not view.flags.owndata and probe[4095].item() == 0xBEEF)
        except Exception:  # noqa: BLE001 - no aliasing: the copying import serves
            _ALIAS_CHECKED.append(False)
    return _ALIAS_CHECKED[0]


def spill_item(namespace: str, tokens: Sequence[int], caches: Sequence[Any]) -> SpillItem | None:
    """Materialize caches covering exactly `tokens` for the writer; None when they cannot be
    stored (an unsupported cache kind, or coverage that does not match the key). Full-precision
    (`KVCache`) and quantized (`QuantizedKVCache`) layers may mix, as per-layer schemes do."""
    n = len(tokens)
    layers, tensors = [], []
    for i, cache in enumerate(caches):
        kind = cache.spill_kind
        if kind not in (KV, QKV) or cache.offset != n:
            return None
        if cache.keys is None or cache.values is None:
            return None
        names = tuple(f"l{i}.{suffix}" for suffix in LAYER_TENSORS[kind])
        arrays = [cache.keys, cache.values] if kind == KV else [*cache.keys, *cache.values]
        for name, full in zip(names, arrays):
            tag, data = _export(full[..., :n, :])
            tensors.append(SpillTensor(name=name, dtype=tag, shape=tuple(data.shape), data=data))
        quant = {} if kind == KV else {"bits": cache.quant.bits, "group_size": cache.quant.group_size}
        at = {} if kind == KV else {"converted_at": cache.converted_at}
        layers.append(LayerMeta(kind=kind, offset=n, trimmable=cache.is_trimmable(), tensors=names, **quant, **at))
    if not layers:
        return None
    return SpillItem(namespace=namespace, tokens=tuple(int(t) for t in tokens), layers=layers, tensors=tensors)


class TieredPromptCache(PromptCache):
    def __init__(
        self,
        max_bytes: int,
        ssd: SsdStore | None,
        *,
        min_restore_tokens: int = MIN_RESTORE_TOKENS,
        clock: Callable[[], float] = time.monotonic,
        retention_share: float = RETENTION_SHARE,
    ) -> None:
        super().__init__(max_bytes, retention_share=retention_share, now=clock)
        self.ssd = ssd
        self.min_restore_tokens = min_restore_tokens
        self.clock = clock
        self.restores = 0
        self.restore_misses = 0  # an SSD candidate that failed to restore (quarantined)
        self.restore_ms_last = 0.0
        self.demotions = 0
        self._last_used: dict[EntryKey, float] = {}

    # -- take ----------------------------------------------------------------------------------

    def take(self, prompt: Sequence[int], namespace: str = "", min_tokens: int = 1) -> tuple[list[KVCache] | None, int]:
        cap = len(prompt) - 1
        if self.ssd is not None and self.enabled and cap >= self.min_restore_tokens and len(self.ssd):
            ids = np.asarray(prompt, dtype=np.int64)
            ram = self._best(ids, namespace, cap)
            found = self.ssd.find(ids, namespace, cap)
            if (
                found is not None
                and found[1] > (ram[1] if ram else 0)
                and found[1] >= max(self.min_restore_tokens, min_tokens)
            ):
                caches = self._restore(self.ssd, *found)
                if caches is not None:
                    return caches, found[1]
        caches, usable = super().take(prompt, namespace, min_tokens)
        if caches is not None and self._entries:
            self._last_used[next(reversed(self._entries))] = self.clock()  # the hit is now the MRU
        return caches, usable

    def _restore(self, ssd: SsdStore, entry: IndexEntry, usable: int) -> list[KVCache] | None:
        started = time.perf_counter()
        try:
            direct = _DirectImport()
            header, arrays = ssd.read(entry, into=direct)
            tags = header["tensors"]
            imported = direct.arrays or {name: _import(a, tags[name]["dtype"]) for name, a in arrays.items()}
            caches: list[Any] = []
            for layer in header["layers"]:
                parts = [imported[name] for name in layer["tensors"]]
                if any(a.ndim != 4 or a.shape[2] != layer["offset"] for a in parts):
                    raise ValueError("tensor shapes do not match the layer offset")
                cache: KVCache | QuantizedKVCache
                if layer["kind"] == QKV:
                    quant = LayerQuant(layer["bits"], layer["group_size"])
                    cache = QuantizedKVCache(quant, layer["converted_at"])
                    cache.keys, cache.values = (parts[0], parts[1], parts[2]), (parts[3], parts[4], parts[5])
                elif layer["kind"] == KV and len(parts) == 2:
                    cache = KVCache()
                    cache.keys, cache.values = parts
                else:
                    raise ValueError(f"unknown layer kind {layer['kind']}")
                cache.offset = layer["offset"]
                caches.append(cache)
            excess = entry.length - usable
            if excess and any(c.trim(excess) != excess for c in caches):
                raise ValueError("entry cannot be trimmed to the match")
            mx.eval([c.state for c in caches])
        except FileNotFoundError:
            self.restore_misses += 1
            ssd.forget(entry)  # evicted by the writer between lookup and read: a plain miss
            return None
        except Exception as e:  # noqa: BLE001 - any doubt is a miss
            self.restore_misses += 1
            ssd.discard(entry, str(e) or type(e).__name__)
            return None
        self.restores += 1
        self.restore_ms_last = (time.perf_counter() - started) * 1000
        log.info("SSD cache: restored %d of %d tokens in %.1f ms", usable, entry.length, self.restore_ms_last)
        return caches

    # -- put -----------------------------------------------------------------------------------

    def put(
        self, tokens: Sequence[int], caches: Sequence[KVCache], namespace: str = "", retain_s: float | None = None
    ) -> bool:
        stored = super().put(tokens, caches, namespace, retain_s)
        if stored and self._entries:
            self._last_used[next(reversed(self._entries))] = self.clock()
        return stored

    # -- for the durability and demotion actors (run_exclusive jobs) ----------------------------

    def snapshot(self, tokens: Sequence[int], namespace: str = "") -> SpillItem | None:
        entry = self._entries.get(EntryKey(namespace, tuple(int(t) for t in tokens)))
        if entry is None:
            return None
        item = spill_item(namespace, entry.key.tokens, entry.caches)
        if item is not None and entry.deadline is not None and entry.deadline > self.clock():
            # A hinted entry keeps its promise on disk too (cache/ssd_index.py), in wall-clock time.
            item.retain_until = time.time() + (entry.deadline - self.clock())
        return item

    def demote_idle(self, idle_s: float) -> list[SpillItem]:
        """Free the RAM of entries unused for `idle_s`; return the ones the SSD lacks."""
        if self.ssd is None:
            return []  # no cold tier: demotion would only lose entries
        now = self.clock()
        out: list[SpillItem] = []
        for key in [k for k in self._last_used if k not in self._entries]:
            del self._last_used[key]
        # Hinted entries first (the spill queue writes in order), least recently used first within each.
        for key, entry in sorted(self._entries.items(), key=lambda item: item[1].retain_s is None):
            last = self._last_used.setdefault(key, now)
            if now - last < idle_s or self._held(entry, now):
                continue
            if not self.ssd.has_exact(key.tokens, key.namespace):
                item = spill_item(key.namespace, key.tokens, entry.caches)
                if item is None:
                    continue  # cannot be stored: keep it in RAM rather than lose it
                out.append(item)
            self._remove(key)
            self._last_used.pop(key, None)
            self.demotions += 1
        return out

    def demote_all(self) -> list[SpillItem]:
        """Empty the RAM tier, protected entries included (its model is leaving the pool:
        actors/pool.py); return the entries the SSD lacks, hinted ones first. An entry that cannot
        be stored is dropped: nothing keeps the RAM it would hold."""
        if self.ssd is None:
            return []
        out: list[SpillItem] = []
        for key, entry in sorted(self._entries.items(), key=lambda item: item[1].retain_s is None):
            if not self.ssd.has_exact(key.tokens, key.namespace):
                item = spill_item(key.namespace, key.tokens, entry.caches)
                if item is not None:
                    if entry.deadline is not None and entry.deadline > self.clock():
                        item.retain_until = time.time() + (entry.deadline - self.clock())
                    out.append(item)
            self._remove(key)
            self.demotions += 1
        self._last_used.clear()
        return out
