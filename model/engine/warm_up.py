"""The shapes an engine meets before serving (`Engine.warm_up` runs these on throwaway rows).

A shape's first run pays one-off costs — compiling the decode stages, kernel JIT, GEMM plans,
and on CUDA a cuDNN attention graph — that would otherwise stall a live stream:
  * every decode batch size from 1 to `max_batch`;
  * with `warm_decode_capacity`, one B=1 decode against KV buffers of each capacity up to it;
  * with `unfused_hit_prefill`, a suffix prefill after a prompt-cache hit at each common width;
  * with prefill buckets, the common fresh-prompt prefill shapes (`Engine.prefill_shapes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from model.engine.params import SamplingParams
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.kv.cache import STEP, KVCache, at_capacity
from model.nn.language_model import LanguageModel
from model.options import ResolvedEngine


class Engine(Protocol):
    """What warm-up drives: `model.engine.engine.Engine`'s row calls (kept as a protocol so the engine
    can call into this module without an import cycle)."""

    model: LanguageModel
    options: ResolvedEngine

    def open_row(self, spec: RowSpec) -> RowOpened: ...
    def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress: ...
    def prefill_group(self, row_ids: Sequence[int]) -> list[PrefillProgress]: ...
    def join(self, row_id: int) -> TokenOut: ...
    def step(self) -> list[TokenOut]: ...
    def close_row(self, row_id: int, *, reusable: bool = False) -> None: ...
    def row_caches(self, row_id: int) -> list[KVCache]: ...
    def prefill_shapes(self, max_batch: int) -> list[tuple[int, int]]: ...


# Suffix lengths met after a prefix of HIT_WARM_PREFIX tokens (unfused_hit_prefill).
HIT_WARM_PREFIX = 256
HIT_WARM_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512)


def prefill_shapes(options: ResolvedEngine, max_batch: int, group_pad_tokens: int) -> list[tuple[int, int]]:
    """(rows, width) of the fresh-prompt prefill forwards worth meeting before serving: with
    `prefill_bucket`, one row at 1, 2, 4 ... 32 buckets (up to a chunk); with `group_bucket`,
    groups of 2, 4 ... `max_batch` rows at one and two buckets (while rows x width stays within
    `group_pad_tokens`). Exact widths never repeat reliably, so without buckets there is nothing."""
    b, g, chunk = options.prefill_bucket, options.group_bucket, options.prefill_chunk
    solo = [(1, b << k) for k in range(6) if b << k <= chunk] if b else []
    counts = [1 << k for k in range(1, 6) if 1 << k <= max_batch] if g else []
    return solo + [(n, w) for n in counts for w in (g, 2 * g) if n * w <= group_pad_tokens]


def warm_up(engine: Any, max_batch: int, *, prompt_len: int = 8) -> None:
    """Meet the shapes serving will run on throwaway rows of `engine` (a model.engine.engine.Engine), so
    their one-off costs (compiling the decode stages, kernel JIT, GEMM plans, attention graphs)
    are paid before serving instead of as a stall in live streams. Needs an idle engine; leaves
    it idle, with nothing put to the prompt cache."""
    if engine._rows:
        raise RuntimeError("warm_up needs an idle engine")
    eos, engine.eos = engine.eos, frozenset()  # a throwaway row must not finish early
    cache, engine.prompt_cache = engine.prompt_cache, None  # nor count in the cache's stats
    try:
        meet_shapes(engine, max_batch, prompt_len=prompt_len)
    finally:
        for rid in list(engine._rows):
            engine.close_row(rid)
        engine.eos, engine.prompt_cache = eos, cache
        engine._steps = 0
        mx.synchronize()
        mx.clear_cache()


def meet_shapes(engine: Engine, max_batch: int, *, prompt_len: int = 8) -> None:
    """Run every shape above once on `engine`, which must be idle (rows it opens may be left
    open on an error: the caller closes them)."""
    ids = [-1 - b for b in range(max(1, max_batch))]
    for rid in ids:
        prompt = tuple(1 + (rid * 7 + i) % 13 for i in range(prompt_len))
        engine.open_row(RowSpec(rid, prompt, SamplingParams(), 1 << 30))
        while engine.prefill(rid).remaining:
            pass
        engine.join(rid)
        engine.step()
        engine.step()
    for rid in ids:
        engine.close_row(rid)
    _decode_capacities(engine, ids[0])
    _hit_prefills(engine, ids[0])
    for count, width in engine.prefill_shapes(max_batch):
        rows = ids[:count]
        for rid in rows:  # prompt[:-1] is exactly `width` long: no padding
            engine.open_row(RowSpec(rid, tuple(1 + (rid * 5 + i) % 11 for i in range(width + 1)), SamplingParams(), 1))
        if count > 1:
            engine.prefill_group(rows)
        else:
            engine.prefill(rows[0])
        for rid in rows:
            engine.close_row(rid)


def _hit_prefills(engine: Engine, rid: int) -> None:
    """With `unfused_hit_prefill`: one suffix forward after a 256-token prefix at each width
    of HIT_WARM_WIDTHS. On CUDA the first prefill after a hit at a new suffix length cost
    47-58 ms against ~19 ms once its kernels had been met (H200, benchmarks/shape_cost.py
    hitshape: a new k length alone costs nothing); the GEMM kernels cuBLAS picks change with
    the row count, and each is loaded on first use."""
    if not engine.options.unfused_hit_prefill:
        return
    engine.open_row(RowSpec(rid, tuple(1 + i % 17 for i in range(HIT_WARM_PREFIX + 1)), SamplingParams(), 1))
    while engine.prefill(rid).remaining:
        pass
    prefix = engine.row_caches(rid)
    engine.close_row(rid)
    for width in HIT_WARM_WIDTHS:
        caches = [c.clone() for c in prefix]
        engine.model(mx.array([[1 + i % 19 for i in range(width)]]), caches, unfused_attention=True)
        mx.eval([c.state for c in caches])


def _decode_capacities(engine: Engine, rid: int) -> None:
    """One decode forward against KV buffers of each capacity up to `warm_decode_capacity`. On
    CUDA the first decode step against a buffer of a new capacity costs ~0.4 s (H200, measured
    per capacity and not per batch size: benchmarks/shape_cost.py capacity), so without this a
    long stream stalls every 256 tokens and a cold 4k prompt's token 0 waits 0.7 s."""
    if engine.options.warm_decode_capacity < STEP:
        return
    engine.open_row(RowSpec(rid, (1, 2, 3), SamplingParams(), 1))
    engine.prefill(rid)  # real caches: their dtype and head shapes
    template = engine.row_caches(rid)
    engine.close_row(rid)
    for capacity in range(STEP, engine.options.warm_decode_capacity + 1, STEP):
        caches = [at_capacity(t, capacity) for t in template]
        mx.eval(engine.model(mx.array([[1]]), caches))
        mx.clear_cache()
