"""Prefill and decode primitives over a continuously batched set of rows.

This is the MLX side of `actors/worker_api.py`: the GPU-worker calls these methods on its thread,
one at a time. The engine holds no policy; the scheduler decides what runs when.

Row life: `open_row` (fresh solo caches) → `prefill` per chunk of `prompt[:-1]` → `join` (token 0
from an L=1 forward of the last prompt token, mlx-lm's convention; the row then enters the batch)
→ `step` per decode step → `close_row`.

The batch "adopts" the first joiner's solo caches, so one active row runs literally the serial
graph (int offsets, fused causal masks). A second joiner merges everyone into left-padded
`BatchKVCache`s; when the batch shrinks back to one row, it is converted back to solo caches.

Decode is pipelined like mlx-lm's generate_step: each `step` dispatches step n+1's graph (fed by
step n's still-unread tokens) with `async_eval` before reading step n's tokens, so the host never
idles the device. A row that has finished may have one extra step computed; it is never emitted.

Prompt cache (optional): `open_row` restores the longest cached prefix, so prefill forwards only
the rest; the chunk that reaches `RowSpec.snapshot_at` puts clones trimmed back to exactly that
prefix; `close_row(reusable=True)` puts the row's KV keyed by exactly the tokens it covers
(prompt + every generated token fed into a forward). The coverage is read from the cache offset,
never assumed: when it cannot be matched to known tokens, nothing is put.

Prefill shapes (CUDA): MLX builds a cuDNN attention graph per new (rows, q, k) shape, ~66 ms on
an H200 against well under 1 ms to run it. So a group prefill rounds its width (and row count)
up to buckets that recur, a prefill after a prompt-cache hit runs its attention unfused (its k
length is new almost every time), and a cold solo prompt keeps its exact width — and with it
mlx-lm's greedy tokens — unless `prefill_bucket` asks for padding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import mlx.core as mx

from model.kv_cache import STEP, BatchKVCache, KVCache, PrefixCache, make_caches
from model.layers import CompiledDecode, DecoderModel
from model.params import SamplingParams
from model.rows import PrefillProgress, RowOpened, RowSpec, TokenOut, TopLogprob
from model.sampling import RowSampler, logprobs_of, observe_batch

log = logging.getLogger(__name__)

CLEAR_CACHE_EVERY = 256
# Group prefill widths round up to a multiple of this on a GPU (`group_bucket`): MLX's CUDA
# attention builds a cuDNN graph for every new (rows, q, k) shape — about 66 ms on an H200
# against 0.4 ms to run it — so arbitrary widths each paid that; rounded ones repeat.
PREFILL_BUCKET = 64
# A group's row count rounds up to a power of two (duplicate rows) while the padded forward
# stays under this many tokens: the count is part of the attention graph's shape too.
GROUP_PAD_TOKENS = 8192
# A prefill after a prompt-cache hit runs its attention unfused (see `unfused_hit_prefill`) while
# the scores matrix — heads x suffix x (prefix + suffix) floats — stays under this.
UNFUSED_SCORES_BYTES = 256 << 20
# Below this, a boundary snapshot or a merged row's extraction (a copy) costs about what it saves.
MIN_CACHE_TOKENS = 256
# KV capacities warm-up meets on CUDA (each costs one throwaway B=1 decode forward; ~2.5 s of
# start-up for 256 ... 8192 on an H200): past it a long stream pays ~0.4 s per 256 tokens.
WARM_DECODE_CAPACITY = 8192
# Suffix lengths warm-up prefills after a prefix of HIT_WARM_PREFIX tokens (unfused_hit_prefill).
HIT_WARM_PREFIX = 256
HIT_WARM_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512)
# Release MLX's freed buffers after every prefill and each CLEAR_CACHE_EVERY steps (as mlx-lm
# does)? Not on CUDA: there every fresh buffer is new managed memory that the GPU first-touches,
# and keeping freed buffers for reuse measured c=8 568 vs 430 tok/s and c=32 1082 vs 967 on the
# H200 (ITL p99 74 vs 140 ms; docs/performance.md). MLX still frees cached buffers itself when
# an allocation would pass its memory limit. MLX_TRIO_CLEAR_CACHE=0/1 overrides.
_CUDA = mx.default_device().type == mx.gpu and not mx.metal.is_available()
CLEAR_CACHE = os.environ.get("MLX_TRIO_CLEAR_CACHE", "0" if _CUDA else "1") != "0"
# Rows with a boundary snapshot (most chat requests) join group prefills; =0 leaves them out, as
# before 2026-12-05 (for A/B measurements only).
GROUP_SNAPSHOT_ROWS = os.environ.get("MLX_TRIO_GROUP_SNAPSHOT_ROWS", "1") != "0"
# Rows closed between two steps leave the batch's KV in one filter at the next step; =0 filters
# at every close, as before 2026-12-05 (for A/B measurements only).
COALESCE_LEAVES = os.environ.get("MLX_TRIO_COALESCE_LEAVES", "1") != "0"


@attrs.define(eq=False)
class _Row:
    row_id: int
    prompt: list[int]
    sampler: RowSampler
    max_tokens: int
    caches: list[KVCache] | None
    processed: int = 0  # prompt tokens whose KV is in the caches
    restored: int = 0  # of those, the ones restored from the prompt cache at open
    sampled: int = 0  # tokens whose sampling has been dispatched (drives the RNG step)
    generated: int = 0  # tokens read back and reported
    last_token: int = -1
    history: mx.array | None = None  # recent tokens, for penalty processors
    finished: bool = False
    in_batch: bool = False
    namespace: str = ""
    snapshot_at: int | None = None  # prefill splits here and puts a clone of the caches
    tokens: list[int] = attrs.Factory(list)  # every generated token, in order (the put key's tail)


@attrs.define(eq=False)
class _Inflight:
    """A dispatched decode step whose results have not been read yet."""

    rows: list[_Row]
    tokens: mx.array  # [B]
    logprobs: list[mx.array | None]  # per row: logprob of the sampled token
    tops: list[tuple[mx.array, mx.array] | None]  # per row: (ids, logprobs) of the top-k

    def keep(self, indices: list[int]) -> None:
        self.rows = [self.rows[i] for i in indices]
        self.tokens = self.tokens[mx.array(indices)]
        self.logprobs = [self.logprobs[i] for i in indices]
        self.tops = [self.tops[i] for i in indices]


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        *,
        eos_token_ids: Iterable[int],
        protected_ids: Iterable[int] = (),
        prefill_chunk: int = 2048,
        prompt_cache: PrefixCache | None = None,
        grammar_compiler: Any = None,  # model.grammar.GrammarCompiler: enforces SamplingParams.constraint
        compile_decode: bool | None = None,
        prefill_bucket: int | None = None,
        group_bucket: int | None = None,
        unfused_hit_prefill: bool | None = None,
    ) -> None:
        self.model = model
        self.grammars = grammar_compiler
        self.eos = frozenset(eos_token_ids)
        self.protected = frozenset(protected_ids) | self.eos
        self.prefill_chunk = prefill_chunk
        # Right-pad a row's own prefill forwards to a multiple of this (0 = exact widths, the
        # default). The padding sits after the real tokens, so causal attention keeps it out of
        # their keys and values, and it is trimmed off the caches. Opt-in: the KV is the same
        # math, but on CUDA cuBLAS picks GEMM kernels by shape, and on the 8B shape a padded
        # prefill's greedy tokens left mlx-lm's at token 0 (benchmarks/shape_cost.py).
        if prefill_bucket is None:
            prefill_bucket = int(os.environ.get("MLX_TRIO_PREFILL_BUCKET", 0))
        self.prefill_bucket = max(0, prefill_bucket)
        # The same for a group prefill's shared width (already a batched, padded forward, as
        # mlx-lm's BatchGenerator runs): None = MLX_TRIO_GROUP_BUCKET, else PREFILL_BUCKET on a
        # GPU and 0 elsewhere.
        if group_bucket is None:
            default = PREFILL_BUCKET if mx.default_device().type == mx.gpu else 0
            group_bucket = int(os.environ.get("MLX_TRIO_GROUP_BUCKET", default))
        self.group_bucket = max(0, group_bucket)
        # A prefill after a prompt-cache hit (a chat's next turn, a shared system prompt) has a
        # new attention k length almost every time, and on CUDA each new shape costs a cuDNN graph
        # (~66 ms on an H200, more than the whole forward). Its attention then runs as matmuls
        # (model.layers.UNFUSED_CAUSAL), MLX's fallback formula, which builds nothing. A cold
        # prompt never takes this path, so its tokens stay mlx-lm's. None = on under CUDA only
        # (MLX_TRIO_UNFUSED_HIT=0/1 overrides); Metal and CPU have no per-shape cost.
        if unfused_hit_prefill is None:
            unfused_hit_prefill = os.environ.get("MLX_TRIO_UNFUSED_HIT", "1" if _CUDA else "0") != "0"
        self.unfused_hit_prefill = unfused_hit_prefill
        self._heads = int(getattr(model.args, "num_attention_heads", 0) or 0)
        # Warm-up also decodes one token against KV buffers of every capacity 256, 512 ... N.
        # On CUDA the first decode step against a buffer of a new capacity costs ~0.4 s (H200,
        # measured per capacity and not per batch size: benchmarks/shape_cost.py capacity), so
        # without this a long stream stalls every 256 tokens and a cold 4k prompt's token 0
        # waits 0.7 s. N = MLX_TRIO_WARM_DECODE_CAPACITY, default WARM_DECODE_CAPACITY on CUDA
        # and 0 elsewhere (CPU has no such cost; Metal is unmeasured).
        self.warm_decode_capacity = int(
            os.environ.get("MLX_TRIO_WARM_DECODE_CAPACITY", WARM_DECODE_CAPACITY if _CUDA else 0)
        )
        self.prompt_cache = prompt_cache
        self.num_layers = len(model.layers)
        self._rows: dict[int, _Row] = {}
        self._batch: list[_Row] = []
        self._caches: list[KVCache] | list[BatchKVCache] | None = None
        self._inflight: _Inflight | None = None
        # Rows closed since the last step (in_batch False), still in the batch's arrays: dropped
        # from the KV in one gather at the next step or join (`_settle_departures`), because
        # each filter copies the whole batch's KV (CPU, B=32: 5-8 ms, most of a step) and the
        # rows of a group finish together.
        self._departed = 0
        self._ready: list[TokenOut] = []  # tokens read early (pipeline flush at a join)
        self._steps = 0
        # Compiled decode stages (model.layers.CompiledDecode): same numerics, far fewer host
        # ops per step. MLX_TRIO_COMPILE=0 (or compile_decode=False) runs the eager graph.
        if compile_decode is None:
            compile_decode = os.environ.get("MLX_TRIO_COMPILE", "1") != "0"
        compiled = CompiledDecode(model) if compile_decode else None
        self._compiled = compiled if compiled is not None and compiled.enabled else None

    # -- row lifecycle ---------------------------------------------------------------------

    def open_row(self, spec: RowSpec) -> RowOpened:
        if not spec.prompt:
            raise ValueError("empty prompt")
        if spec.row_id in self._rows:
            raise ValueError(f"row {spec.row_id} already open")
        row = _Row(
            row_id=spec.row_id,
            prompt=list(spec.prompt),
            sampler=RowSampler(spec.sampling, protected_ids=self.protected, grammars=self.grammars),
            max_tokens=max(1, spec.max_tokens),
            caches=None,
            namespace=spec.namespace,
        )
        row.caches, row.processed = self._take(row.prompt, spec.namespace, spec.min_cached_tokens)
        row.restored = row.processed
        if spec.snapshot_at is not None and self.prompt_cache is not None:
            at = min(spec.snapshot_at, len(row.prompt) - 1)
            if at >= MIN_CACHE_TOKENS and at > row.processed:
                row.snapshot_at = at
        self._rows[spec.row_id] = row
        return RowOpened(row.row_id, cached_tokens=row.processed, to_prefill=len(row.prompt) - 1 - row.processed)

    def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        """One chunk of the row's prompt: `prefill_chunk` tokens, or fewer when `max_tokens` says
        so (the scheduler's smaller chunk while other rows are decoding)."""
        row = self._rows[row_id]
        chunk_tokens = min(self.prefill_chunk, max_tokens) if max_tokens else self.prefill_chunk
        end = min(row.processed + chunk_tokens, len(row.prompt) - 1)
        if end > row.processed:
            chunk = row.prompt[row.processed : end]
            trimmable = self.prefill_bucket and all(c.is_trimmable() for c in row.caches)
            pad = _padding(len(chunk), self.prefill_bucket) if trimmable else 0
            width = len(chunk) + pad
            unfused = (
                self.unfused_hit_prefill
                and row.restored > 0
                and 4 * self._heads * width * (row.processed + width) <= UNFUSED_SCORES_BYTES
            )
            self.model(mx.array(chunk + chunk[-1:] * pad)[None], row.caches, unfused_attention=unfused)
            for c in row.caches:
                c.trim(pad)
            mx.eval([c.state for c in row.caches])
            row.processed = end
            if CLEAR_CACHE:
                mx.clear_cache()
        self._snapshot_if_passed(row)
        return self._progress(row_id)

    def _snapshot_if_passed(self, row: _Row) -> None:
        if row.snapshot_at is not None and row.processed >= row.snapshot_at:
            # The forward ran past the boundary: attention is causal, so the KV of the tokens
            # before it is what a forward stopping there computes. Clones trimmed back to the
            # boundary are the snapshot — one forward instead of two (on CUDA each new prefill
            # shape also costs MLX an attention graph).
            at, row.snapshot_at = row.snapshot_at, None
            snapshot = [c.clone() for c in row.caches]
            for c in snapshot:
                c.trim(row.processed - at)
            self._put(row.prompt[:at], snapshot, row.namespace)

    def _progress(self, row_id: int) -> PrefillProgress:
        row = self._rows[row_id]
        return PrefillProgress(row_id, done=row.processed, remaining=len(row.prompt) - 1 - row.processed)

    def groupable(self, row_id: int) -> bool:
        """Whether `prefill_group` can take this row: freshly opened (no cached prefix) with a
        whole prompt[:-1] of one chunk at most. A boundary snapshot inside it is taken after the
        group's forward, as after a solo chunk that runs past it."""
        row = self._rows[row_id]
        todo = len(row.prompt) - 1 - row.processed
        return (
            row.processed == 0 and 0 < todo <= self.prefill_chunk and (GROUP_SNAPSHOT_ROWS or row.snapshot_at is None)
        )

    def prefill_group(self, row_ids: Sequence[int]) -> list[PrefillProgress]:
        """Prefill the groupable ones of these rows in one right-padded forward, then give each
        its own solo caches (padding stripped), exactly the state `prefill` leaves. Rows it cannot
        take are left as they are (the scheduler prefills them alone); the result is every row's
        progress, in order. A burst of short arrivals pays one forward — and on CUDA one
        attention graph, which MLX builds per new shape — instead of one per row. Numerically
        this is a batched prefill, as mlx-lm's BatchGenerator runs."""
        # With buckets, one forward per bucket: less padding, and (rows, width) shapes that recur.
        clusters: dict[int, list[_Row]] = {}
        for row_id in row_ids:
            if self.groupable(row_id):
                row = self._rows[row_id]
                todo = len(row.prompt) - 1
                clusters.setdefault(todo + _padding(todo, self.group_bucket) if self.group_bucket else 0, []).append(
                    row
                )
        for rows in clusters.values():
            if len(rows) == 1:
                self.prefill(rows[0].row_id)
            else:
                self._prefill_together(rows)
        return [self._progress(r) for r in row_ids]

    def _prefill_together(self, rows: list[_Row]) -> None:
        # Right-padded, so every row starts at position 0 and plain causal attention keeps each
        # row's padding out of its real tokens: no mask array (on CUDA an array mask makes cuDNN
        # build a graph that costs over a second per new shape, a causal one ~66 ms).
        lengths = [len(r.prompt) - 1 for r in rows]
        width = max(lengths) + _padding(max(lengths), self.group_bucket)
        tokens = [r.prompt[:n] + r.prompt[n - 1 : n] * (width - n) for r, n in zip(rows, lengths)]
        count = len(rows)
        if self.group_bucket:
            padded_count = 1 << (count - 1).bit_length()
            if padded_count * width <= GROUP_PAD_TOKENS:
                tokens += tokens[:1] * (padded_count - count)  # duplicates, dropped below
        caches = make_caches(self.num_layers)
        self.model(mx.array(tokens), caches)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            row.caches = [c.row(i, n) for c in caches]
            row.processed = n
        mx.eval([c.state for row in rows for c in row.caches])
        for row in rows:
            self._snapshot_if_passed(row)
        if CLEAR_CACHE:
            mx.clear_cache()

    def join(self, row_id: int) -> TokenOut:
        row = self._rows[row_id]
        if row.processed != len(row.prompt) - 1:
            raise RuntimeError(f"row {row_id} joined before its prefill finished")
        last = mx.array(row.prompt[-1:])
        hidden = self.model(last[None], row.caches)
        row.processed += 1
        if row.sampler.history_size:
            row.history = mx.array(row.prompt[-row.sampler.history_size :])
        token, lp, top = self._sample_row(row, self.model.logits(hidden[:, -1, :]))
        mx.eval(token, *([lp] if lp is not None else []), *(top or ()))
        out = self._record(row, int(token.item()), lp, top)
        if not row.finished:
            self._admit_to_batch([row])
        return out

    def join_group(self, row_ids: Sequence[int]) -> list[TokenOut | None]:
        """Prefilled rows enter the batch together with their last prompt token still to feed:
        the next decode forward computes every row's token 0 along with the running rows' next
        tokens, so N joins cost no forward of their own (`join` runs one L=1 forward per row).
        Token 0 then comes out of `step`; the result here is None for such a row. A
        grammar-constrained row joins the ordinary way (its matcher must see token 0 before
        the next mask) and its token 0 is returned here, as `join` would."""
        outs: list[TokenOut | None] = []
        deferred: list[_Row] = []
        for row_id in row_ids:
            row = self._rows[row_id]
            if row.processed != len(row.prompt) - 1:
                raise RuntimeError(f"row {row_id} joined before its prefill finished")
            if row.sampler.constrained:
                outs.append(self.join(row_id))
                continue
            # The dispatch feeds last_token and, for penalty processors, appends it to history.
            row.last_token = row.prompt[-1]
            if row.sampler.history_size:
                row.history = mx.array(row.prompt[:-1][-row.sampler.history_size :])
            deferred.append(row)
            outs.append(None)
        if deferred:
            self._admit_to_batch(deferred)
        return outs

    def step(self) -> list[TokenOut]:
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        self._settle_departures()
        if not self._batch:
            return []
        if self._inflight is None:
            self._inflight = self._dispatch(mx.array([r.last_token for r in self._batch]))
        current = self._inflight
        self._inflight = self._dispatch(current.tokens)
        self._steps += 1
        if CLEAR_CACHE and self._steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return self._read(current)

    def close_row(self, row_id: int, *, reusable: bool = False) -> None:
        row = self._rows.pop(row_id, None)
        if row is None:
            return
        row.finished = True
        if reusable and self.prompt_cache is not None:
            try:
                self._put_row(row)
            except Exception:
                # A failed put is a future cache miss; the row must still leave the batch.
                log.exception("prompt cache put for row %d failed", row_id)
        if row.in_batch:
            self._leave_batch(row)
        row.caches = None
        self._ready = [t for t in self._ready if t.row_id != row_id]

    def warm_up(self, max_batch: int, *, prompt_len: int = 8) -> None:
        """Meet every decode batch size from 1 to `max_batch` once, on throwaway rows, so the
        one-off costs of a new shape (compiling the decode stages, kernel JIT, GEMM plans) are
        paid before serving instead of as a stall in live streams. With prefill buckets, also
        the common prefill shapes (`prefill_shapes`). Needs an idle engine."""
        if self._rows:
            raise RuntimeError("warm_up needs an idle engine")
        eos, self.eos = self.eos, frozenset()  # a throwaway row must not finish early
        cache, self.prompt_cache = self.prompt_cache, None  # nor count in the cache's stats
        ids = [-1 - b for b in range(max(1, max_batch))]
        try:
            for rid in ids:
                prompt = tuple(1 + (rid * 7 + i) % 13 for i in range(prompt_len))
                self.open_row(RowSpec(rid, prompt, SamplingParams(), 1 << 30))
                while self.prefill(rid).remaining:
                    pass
                self.join(rid)
                self.step()
                self.step()
            for rid in ids:
                self.close_row(rid)
            self._warm_decode_capacities(ids[0])
            self._warm_hit_prefills(ids[0])
            for count, width in self.prefill_shapes(max_batch):
                rows = ids[:count]
                for rid in rows:  # prompt[:-1] is exactly `width` long: no padding
                    self.open_row(
                        RowSpec(rid, tuple(1 + (rid * 5 + i) % 11 for i in range(width + 1)), SamplingParams(), 1)
                    )
                if count > 1:
                    self.prefill_group(rows)
                else:
                    self.prefill(rows[0])
                for rid in rows:
                    self.close_row(rid)
        finally:
            for rid in ids:
                self.close_row(rid)
            self.eos, self.prompt_cache = eos, cache
            self._steps = 0
            mx.synchronize()
            mx.clear_cache()

    def _warm_hit_prefills(self, rid: int) -> None:
        """With `unfused_hit_prefill`: one suffix forward after a 256-token prefix at each width
        of HIT_WARM_WIDTHS. On CUDA the first prefill after a hit at a new suffix length cost
        47-58 ms against ~19 ms once its kernels had been met (H200, benchmarks/shape_cost.py
        hitshape: a new k length alone costs nothing); the GEMM kernels cuBLAS picks change with
        the row count, and each is loaded on first use."""
        if not self.unfused_hit_prefill:
            return
        self.open_row(RowSpec(rid, tuple(1 + i % 17 for i in range(HIT_WARM_PREFIX + 1)), SamplingParams(), 1))
        while self.prefill(rid).remaining:
            pass
        prefix = self._rows[rid].caches
        self.close_row(rid)
        for width in HIT_WARM_WIDTHS:
            caches = [c.clone() for c in prefix]
            self.model(mx.array([[1 + i % 19 for i in range(width)]]), caches, unfused_attention=True)
            mx.eval([c.state for c in caches])

    def _warm_decode_capacities(self, rid: int) -> None:
        """One decode forward against KV buffers of each capacity up to `warm_decode_capacity`."""
        if self.warm_decode_capacity < STEP:
            return
        self.open_row(RowSpec(rid, (1, 2, 3), SamplingParams(), 1))
        self.prefill(rid)  # real caches: their dtype and head shapes
        template = self._rows[rid].caches
        self.close_row(rid)
        for capacity in range(STEP, self.warm_decode_capacity + 1, STEP):
            caches = []
            for t in template:
                c = KVCache()
                c.keys = mx.zeros((1, t.keys.shape[1], capacity, t.keys.shape[3]), t.keys.dtype)
                c.values = mx.zeros((1, t.values.shape[1], capacity, t.values.shape[3]), t.values.dtype)
                c.offset = capacity - 1
                caches.append(c)
            mx.eval(self.model(mx.array([[1]]), caches))
            mx.clear_cache()

    def prefill_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        """(rows, width) of the fresh-prompt prefill forwards worth meeting before serving: with
        `prefill_bucket`, one row at 1, 2, 4 ... 32 buckets (up to a chunk); with `group_bucket`,
        groups of 2, 4 ... `max_batch` rows at one and two buckets. Exact widths never repeat
        reliably, so without buckets there is nothing to meet."""
        b, g = self.prefill_bucket, self.group_bucket
        solo = [(1, b << k) for k in range(6) if b << k <= self.prefill_chunk] if b else []
        counts = [1 << k for k in range(1, 6) if 1 << k <= max_batch] if g else []
        return solo + [(n, w) for n in counts for w in (g, 2 * g) if n * w <= GROUP_PAD_TOKENS]

    @property
    def active_rows(self) -> int:
        return len(self._rows)

    @property
    def batch_size(self) -> int:
        return len(self._batch) - self._departed

    # -- prompt cache ----------------------------------------------------------------------------

    def _take(self, prompt: list[int], namespace: str, min_tokens: int = 1) -> tuple[list[KVCache], int]:
        if self.prompt_cache is not None:
            caches, cached = self.prompt_cache.take(prompt, namespace, min_tokens)
            if (
                caches is not None
                and len(caches) == self.num_layers
                and all(isinstance(c, KVCache) and c.offset == cached for c in caches)
            ):
                return caches, cached
        return make_caches(self.num_layers), 0

    def _put(self, tokens: Sequence[int], caches: list[KVCache], namespace: str) -> None:
        assert self.prompt_cache is not None
        if any(c.offset != len(tokens) for c in caches):
            return
        self.prompt_cache.put(tokens, caches, namespace)

    def _put_row(self, row: _Row) -> None:
        """Put a closing row's KV, keyed by exactly what it covers; called before it leaves."""
        if not row.in_batch:
            caches = row.caches  # never joined (finished at token 0, or closed mid-prefill)
        elif isinstance(self._caches[0], KVCache):
            caches = self._caches  # the lone row holds the batch state: hand it over, no copy
        elif len(row.prompt) >= MIN_CACHE_TOKENS:
            i = self._batch.index(row)
            caches = [c.extract(i) for c in self._caches]
            # Materialize the copy now: a lazy slice would pin the whole batch buffer.
            mx.eval([c.state for c in caches])
        else:
            return
        if not caches:
            return
        covered = caches[0].offset
        known = row.prompt + row.tokens
        # More KV than known tokens means a forward was fed a token we never read (a step
        # computed ahead after the row finished): its key would be a guess, so no put.
        if covered == 0 or covered > len(known):
            return
        self._put(known[:covered], list(caches), row.namespace)

    # -- batch membership --------------------------------------------------------------------

    def _admit_to_batch(self, rows: list[_Row]) -> None:
        """Rows whose caches cover their prompt so far enter the batch: one merge, one extend."""
        self._settle_departures()
        if self._inflight is not None:
            # Settle the row set first: read the in-flight step and hold its tokens for `step`.
            self._ready.extend(self._read(self._inflight))
            self._inflight = None
        joining = rows
        if not self._batch:
            self._caches, rows = rows[0].caches, rows[1:]  # adopt: one row runs the serial graph
        if rows and isinstance(self._caches[0], KVCache):  # one row so far: its solo caches join the merge
            self._caches = [
                BatchKVCache.merge([solo, *(r.caches[layer] for r in rows)]) for layer, solo in enumerate(self._caches)
            ]
        elif rows:
            for layer, batch_cache in enumerate(self._caches):
                batch_cache.extend(BatchKVCache.merge([r.caches[layer] for r in rows]))
        for row in joining:
            row.caches = None
            row.in_batch = True
            self._batch.append(row)

    def _leave_batch(self, row: _Row) -> None:
        row.in_batch = False
        self._departed += 1
        if self._departed == len(self._batch) or not COALESCE_LEAVES:
            self._settle_departures()  # the batch is empty: free its KV now, not at a next step

    def _settle_departures(self) -> None:
        """Drop the rows closed since the last step from the batch: one filter for all."""
        if not self._departed:
            return
        self._departed = 0
        keep = [i for i, r in enumerate(self._batch) if r.in_batch]
        self._batch = [self._batch[i] for i in keep]
        if not self._batch:
            self._caches, self._inflight = None, None
            return
        if isinstance(self._caches[0], BatchKVCache):
            for cache in self._caches:
                cache.filter(keep)
            if len(self._batch) == 1:
                self._caches = [_solo_from_batch(c) for c in self._caches]
        if self._inflight is not None:
            self._inflight.keep(keep)

    # -- decode --------------------------------------------------------------------------------

    def _dispatch(self, inputs: mx.array) -> _Inflight:
        rows = list(self._batch)
        logits = self._decode_logits(inputs[:, None])
        if all(r.sampler.greedy and not r.sampler.params.logprobs and not r.sampler.params.top_logprobs for r in rows):
            tokens = mx.argmax(logprobs_of(logits), axis=-1)
            for r in rows:
                r.sampled += 1
            inflight = _Inflight(rows, tokens, [None] * len(rows), [None] * len(rows))
        else:
            if any(r.sampler.constrained for r in rows):
                # Grammar rows need their previous token on the host: start this forward, read
                # the (already dispatched) inputs, and let the matchers catch up and fill their
                # masks while the device runs it. inputs[i] is row i's token number sampled-1.
                mx.async_eval(logits)
                observe_batch([r.sampler for r in rows], [r.sampled - 1 for r in rows], inputs.tolist())
            per_row = []
            for i, r in enumerate(rows):
                if r.sampler.history_size:
                    r.history = mx.concatenate([r.history, inputs[i : i + 1]])[-r.sampler.history_size :]
                per_row.append(self._sample_row(r, logits[i : i + 1]))
            tokens = mx.concatenate([t for t, _, _ in per_row])
            inflight = _Inflight(rows, tokens, [lp for _, lp, _ in per_row], [top for _, _, top in per_row])
        mx.async_eval(
            inflight.tokens,
            *[lp for lp in inflight.logprobs if lp is not None],
            *[a for top in inflight.tops if top is not None for a in top],
        )
        return inflight

    def _decode_logits(self, tokens: mx.array) -> mx.array:
        """[B, 1] tokens → [B, vocab] logits of one decode forward over the batch's caches."""
        if self._compiled is not None:
            return self._compiled(tokens, self._caches)
        hidden = self.model(tokens, self._caches)
        return self.model.logits(hidden[:, -1, :])

    def _sample_row(
        self, row: _Row, logits: mx.array
    ) -> tuple[mx.array, mx.array | None, tuple[mx.array, mx.array] | None]:
        logits = row.sampler.process(row.history, logits)
        logprobs = logprobs_of(logits)
        token = row.sampler.sample(logprobs, row.sampled)
        row.sampled += 1
        params = row.sampler.params
        lp = top = None
        if params.logprobs or params.top_logprobs:
            lp = mx.take_along_axis(logprobs, token[:, None], axis=-1)[0, 0]
        if params.top_logprobs > 0:
            k = min(params.top_logprobs, logprobs.shape[-1])
            ids = mx.argpartition(-logprobs[0], kth=k - 1)[:k]
            top = (ids, logprobs[0][ids])
        return token, lp, top

    def _read(self, inflight: _Inflight) -> list[TokenOut]:
        tokens = inflight.tokens.tolist()
        outs = []
        for row, token, lp, top in zip(inflight.rows, tokens, inflight.logprobs, inflight.tops):
            if row.finished:
                continue  # computed ahead by the pipeline after the row ended
            outs.append(self._record(row, token, lp, top))
        return outs

    def _record(self, row: _Row, token: int, lp: mx.array | None, top: tuple[mx.array, mx.array] | None) -> TokenOut:
        row.generated += 1
        row.last_token = token
        row.tokens.append(token)
        finish = None
        if token in self.eos:
            finish = "stop"
        elif row.generated >= row.max_tokens:
            finish = "length"
        row.finished = finish is not None
        top_list: tuple[TopLogprob, ...] = ()
        if top is not None:
            pairs = sorted(zip(top[0].tolist(), top[1].tolist()), key=lambda p: -p[1])
            top_list = tuple(TopLogprob(i, v) for i, v in pairs)
        return TokenOut(
            row.row_id, token, finish, logprob=None if lp is None else float(lp.item()), top_logprobs=top_list
        )


def _solo_from_batch(cache: BatchKVCache) -> KVCache:
    """A one-row batch with no padding is exactly a solo cache: hand the buffers over."""
    solo = KVCache()
    if cache.keys is not None:
        pad = cache.pads[0]
        solo.keys = cache.keys[..., pad:, :] if pad else cache.keys
        solo.pinned_slots = cache.keys.shape[2] if pad else 0
        solo.values = cache.values[..., pad:, :] if pad else cache.values
        solo.offset = cache._idx - pad
    return solo


def generate_tokens(engine: Engine, specs: Sequence[RowSpec], *, reusable: bool = False) -> dict[int, list[int]]:
    """Run rows to completion together (test/bench helper): {row_id: generated tokens}.
    `reusable` is close_row's: finished rows are put to the engine's prompt cache."""
    out: dict[int, list[int]] = {}
    live = set()
    for spec in specs:
        engine.open_row(spec)
        while engine.prefill(spec.row_id).remaining:
            pass
        first = engine.join(spec.row_id)
        out[spec.row_id] = [first.token]
        if first.finish:
            engine.close_row(spec.row_id, reusable=reusable)
        else:
            live.add(spec.row_id)
    return decode_to_the_end(engine, out, live, reusable=reusable)


def decode_to_the_end(
    engine: Engine, out: dict[int, list[int]], live: set[int], *, reusable: bool = False
) -> dict[int, list[int]]:
    """Step until every `live` row has finished, appending each token to `out[row_id]` and
    closing rows as they finish (test/bench helper); returns `out`."""
    while live:
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id, reusable=reusable)
                live.discard(t.row_id)
    return out


def _padding(width: int, bucket: int) -> int:
    """Tokens to add after a forward of `width` to reach the next multiple of `bucket` (0 = exact)."""
    return -width % bucket if bucket else 0
