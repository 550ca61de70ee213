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
the rest; the chunk that reaches a snapshot position (`RowSpec.snapshot_at`, `.retain`) puts
clones trimmed back to exactly that prefix; `close_row(reusable=True)` puts the row's KV keyed by
exactly the tokens it covers (prompt + every generated token fed into a forward). The coverage
is read from the cache offset, never assumed: when it cannot be matched to known tokens, nothing is put.

Prefill shapes (CUDA): group prefills round to recurring buckets, a prefill after a hit runs its
attention unfused, a cold solo prompt keeps mlx-lm's exact width (model/options/groups.py says why).
KV quantization (model/kv/scheme.py, model/kv/rows.py): a row's caches turn quantized after the
forward that reaches its conversion point; a prefill chunk ends there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeGuard, cast

import mlx.core as mx

from model.engine import image_rows, row_cache
from model.engine.abort_flags import AbortFlags
from model.engine.compiled_decode import CompiledDecode
from model.engine.decoding import Inflight, Row, read, record, sample_batch, sample_row
from model.engine.prefill_abort import forward_unless_aborted
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.engine.sampling import RowSampler
from model.engine.snapshots import retained_length, snapshot_plan
from model.engine.speculation import Speculation
from model.engine.speculative_step import Speculator
from model.engine.warm_up import prefill_shapes, warm_up
from model.kv.cache import BatchKVCache, KVCache, LayerCache, PrefixCache
from model.kv.rows import convert_at, is_merged, merge_batch, quantize_due, quantize_due_rows
from model.kv.scheme import KVScheme
from model.lora.adapters import AdapterInfo, AdapterSet
from model.nn.decoder import DecoderModel
from model.nn.language_model import LanguageModel
from model.options import EngineOptions, padding, resolve_engine

if TYPE_CHECKING:
    from model.text.grammar import GrammarCompiler

log = logging.getLogger(__name__)

# With `clear_cache`, MLX's freed buffers are released after every prefill and every this many
# steps (as mlx-lm does). Off on CUDA: there every fresh buffer is new managed memory that the GPU
# first-touches, and keeping freed buffers for reuse measured c=8 568 vs 430 tok/s and c=32 1082
# vs 967 on the H200 (ITL p99 74 vs 140 ms; docs/performance.md). MLX still frees cached buffers
# itself when an allocation would pass its memory limit.
CLEAR_CACHE_EVERY = 256
# A group's row count rounds up to a power of two (duplicate rows) while the padded forward
# stays under this many tokens: the count is part of the attention graph's shape too.
GROUP_PAD_TOKENS = 8192
# A prefill after a prompt-cache hit runs its attention unfused (see `unfused_hit_prefill`) while
# the scores matrix — heads x suffix x (prefix + suffix) floats — stays under this.
UNFUSED_SCORES_BYTES = 256 << 20
# Below this, a boundary snapshot or a merged row's extraction (a copy) costs about what it saves.
MIN_CACHE_TOKENS = 256


def _solo(caches: Sequence[LayerCache]) -> TypeGuard[list[KVCache]]:
    """The batch's caches are one row's own (it runs the serial graph)."""
    return bool(caches) and not is_merged(caches)


def _merged(caches: Sequence[LayerCache]) -> TypeGuard[list[BatchKVCache]]:
    return is_merged(caches)


class Engine:
    def __init__(
        self,
        model: LanguageModel,
        *,
        eos_token_ids: Iterable[int],
        protected_ids: Iterable[int] = (),
        prompt_cache: PrefixCache | None = None,
        grammar_compiler: GrammarCompiler | None = None,  # enforces SamplingParams.constraint
        options: EngineOptions = EngineOptions(),
        aborts: AbortFlags | None = None,  # rows to stop prefilling (set from another thread)
        kv_scheme: KVScheme = KVScheme(),  # how the rows' KV is stored (model/kv/scheme.py)
        speculation: Speculation | None = None,  # drafts verified when the batch holds one row
    ) -> None:
        self.model = model
        self.grammars = grammar_compiler
        self.eos = frozenset(eos_token_ids)
        self.protected = frozenset(protected_ids) | self.eos
        gpu = mx.default_device().type == mx.gpu
        cuda = gpu and not mx.metal.is_available()
        self.options = resolve_engine(options, gpu=gpu, cuda=cuda)  # what each one does: model/options/
        self.aborts = aborts if aborts is not None else AbortFlags()
        self.kv_scheme = kv_scheme
        # (Quantized rows turn at exact positions; recurrent states cannot take drafts back.)
        can = (
            model.capabilities.speculation
            and not kv_scheme.quantized
            and all(c.is_trimmable() for c in model.make_caches())
        )
        self.speculator = Speculator(speculation) if speculation and can else None
        self.adapters = AdapterSet(model)  # LoRA adapters mounted at runtime (model/lora/adapters.py)
        self._gpu, self._heads = gpu, model.attention_heads
        self.prompt_cache = prompt_cache
        self.num_layers = len(model.layers)
        self._rows: dict[int, Row] = {}
        self._batch: list[Row] = []
        self._caches: list[KVCache] | list[BatchKVCache] = []  # the batch's; empty without one
        self._inflight: Inflight | None = None
        # Rows closed since the last step (in_batch False), still in the batch's arrays: dropped
        # from the KV in one gather at the next step or join (`_settle_departures`), because
        # each filter copies the whole batch's KV (CPU, B=32: 5-8 ms, most of a step) and the
        # rows of a group finish together.
        self._departed = 0
        self._ready: list[TokenOut] = []  # tokens read early (pipeline flush at a join)
        self._steps = 0
        self.prefill_tokens = 0  # prompt tokens forwarded by prefill (a join feeds the last; a fork none)
        self._cuda = cuda
        self._compiled: CompiledDecode | None = None
        capable = model.capabilities
        if self.options.compile_decode and capable.compiled_decode:
            fuse = self._cuda and capable.fused_projections  # (adapters: model/lora/mount.py)
            self._compiled = CompiledDecode(cast(DecoderModel, self.model), fuse=fuse)

    # -- row lifecycle ---------------------------------------------------------------------

    def open_row(self, spec: RowSpec) -> RowOpened:
        if not spec.prompt:
            raise ValueError("empty prompt")
        if spec.row_id in self._rows:
            raise ValueError(f"row {spec.row_id} already open")
        row = self._new_row(spec)
        row.caches, row.processed = row_cache.take(
            self.prompt_cache, self.kv_scheme, row, self.model.make_caches(), spec.min_cached_tokens
        )
        row.quantized = quantize_due(self.kv_scheme, row.caches, row.processed, row.convert_at)
        row.restored = row.processed
        if self.prompt_cache is not None:  # the boundary and any retention hints (model/engine/snapshots.py)
            row.snapshots = snapshot_plan(spec, row.processed, MIN_CACHE_TOKENS)
        self._rows[spec.row_id] = row
        to_prefill, created = len(row.prompt) - 1 - row.processed, retained_length(row.snapshots)
        return RowOpened(row.row_id, cached_tokens=row.processed, to_prefill=to_prefill, cache_created=created)

    def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        """One chunk of the row's prompt: `prefill_chunk` tokens, or fewer when `max_tokens` says
        so (the scheduler's smaller chunk while other rows are decoding)."""
        row = self._rows[row_id]
        if row.aborted:
            raise RuntimeError(f"row {row_id} was aborted mid-prefill: it can only close")
        options = self.options
        chunk_tokens = min(options.prefill_chunk, max_tokens) if max_tokens else options.prefill_chunk
        end = image_rows.chunk_end(row, row.processed, min(row.processed + chunk_tokens, len(row.prompt) - 1))
        if row.convert_at is not None and row.processed < row.convert_at < end:
            end = row.convert_at  # the chunk ends where the row turns quantized, as mlx-lm's does
        if end > row.processed:
            chunk = row.prompt[row.processed : end]
            trimmable = options.prefill_bucket and row.image is None and all(c.is_trimmable() for c in row.caches)
            pad = padding(len(chunk), options.prefill_bucket) if trimmable else 0
            width, images = len(chunk) + pad, image_rows.inputs(row, row.processed, end)  # (an image row's)
            unfused = (
                options.unfused_hit_prefill
                and row.restored > 0
                and 4 * self._heads * width * (row.processed + width) <= UNFUSED_SCORES_BYTES
            )
            tokens = mx.array(chunk + chunk[-1:] * pad)[None]
            self.adapters.select([row.lora])
            if not forward_unless_aborted(
                self.model, tokens, row.caches, [row], self.aborts, self._gpu, unfused, images
            ):
                return self._progress(row_id)
            for c in row.caches:
                c.trim(pad)
            mx.eval([c.state for c in row.caches])
            self.prefill_tokens += end - row.processed
            row.processed = end
            if options.clear_cache:
                mx.clear_cache()
        self._snapshot_if_passed(row)  # (from the caches as they were computed: before they turn)
        row.quantized = quantize_due(self.kv_scheme, row.caches, row.processed, row.convert_at)
        return self._progress(row_id)

    def _snapshot_if_passed(self, row: Row) -> None:
        while row.snapshots and row.processed >= row.snapshots[0][0]:
            # The forward ran past the boundary: attention is causal, so the KV of the tokens
            # before it is what a forward stopping there computes. Clones trimmed back to the
            # boundary are the snapshot — one forward instead of two (on CUDA each new prefill
            # shape also costs MLX an attention graph).
            (at, retain_s), *row.snapshots = row.snapshots
            snapshot = [c.clone() for c in row.caches]
            for c in snapshot:
                c.trim(row.processed - at)
            assert self.prompt_cache is not None  # (snapshots are planned only with one)
            row_cache.put(self.prompt_cache, self.kv_scheme, row.key[:at], snapshot, row.namespace, retain_s)

    def _progress(self, row_id: int) -> PrefillProgress:
        row = self._rows[row_id]
        return PrefillProgress(row_id, done=row.processed, remaining=len(row.prompt) - 1 - row.processed)

    def groupable(self, row_id: int) -> bool:
        """Whether `prefill_group` can take this row: freshly opened (no cached prefix) with a
        whole prompt[:-1] of one chunk at most, no images. A boundary snapshot inside it is taken
        after the group's forward, as after a solo chunk that runs past it."""
        row = self._rows[row_id]
        todo = len(row.prompt) - 1 - row.processed
        return row.processed == 0 and 0 < todo <= self.options.prefill_chunk and row.image is None

    def prefill_group(self, row_ids: Sequence[int]) -> list[PrefillProgress]:
        """Prefill the groupable ones of these rows in one right-padded forward, then give each
        its own solo caches (padding stripped), exactly the state `prefill` leaves. Rows it cannot
        take are left as they are (the scheduler prefills them alone); the result is every row's
        progress, in order. A burst of short arrivals pays one forward — and on CUDA one
        attention graph, which MLX builds per new shape — instead of one per row. Numerically
        this is a batched prefill, as mlx-lm's BatchGenerator runs."""
        # With buckets, one forward per bucket: less padding, and (rows, width) shapes that recur.
        bucket = self.options.group_bucket
        clusters: dict[int, list[Row]] = {}
        for row_id in row_ids:
            if self.groupable(row_id):
                row = self._rows[row_id]
                todo = len(row.prompt) - 1
                clusters.setdefault(todo + padding(todo, bucket) if bucket else 0, []).append(row)
        for rows in clusters.values():
            if len(rows) == 1:
                self.prefill(rows[0].row_id)
            else:
                self._prefill_together(rows)
        return [self._progress(r) for r in row_ids]

    def _prefill_together(self, rows: list[Row]) -> None:
        # Right-padded, so every row starts at position 0 and plain causal attention keeps each
        # row's padding out of its real tokens: no mask array (on CUDA an array mask makes cuDNN
        # build a graph that costs over a second per new shape, a causal one ~66 ms).
        bucket = self.options.group_bucket
        lengths = [len(r.prompt) - 1 for r in rows]
        width = max(lengths) + padding(max(lengths), bucket)
        tokens = [r.prompt[:n] + r.prompt[n - 1 : n] * (width - n) for r, n in zip(rows, lengths)]
        count = len(rows)
        if bucket:
            padded_count = 1 << (count - 1).bit_length()
            if padded_count * width <= GROUP_PAD_TOKENS:
                tokens += tokens[:1] * (padded_count - count)  # duplicates, dropped below
        caches = self.model.make_caches()
        self.adapters.select([r.lora for r in rows] + [rows[0].lora] * (len(tokens) - count))
        if not forward_unless_aborted(self.model, mx.array(tokens), caches, rows, self.aborts, self._gpu):
            return
        for i, (row, n) in enumerate(zip(rows, lengths)):
            row.caches = [c.row(i, n) for c in caches]
            row.processed = n
        self.prefill_tokens += sum(lengths)
        mx.eval([c.state for row in rows for c in row.caches])
        for row in rows:
            self._snapshot_if_passed(row)
            row.quantized = quantize_due(self.kv_scheme, row.caches, row.processed, row.convert_at)
        if self.options.clear_cache:
            mx.clear_cache()

    def fork_rows(self, source_id: int, specs: Sequence[RowSpec]) -> list[RowOpened]:
        """Rows that go on from `source_id`'s prefilled prompt (the choices of one request forward
        it once): the source has not joined, so its KV covers prompt[:-1]; each new row gets clones
        of it (views: its first write or the batch merge copies) and joins as any prefilled row."""
        source = self._rows[source_id]
        ids = [spec.row_id for spec in specs]
        if source.in_batch or source.processed != len(source.prompt) - 1:
            raise RuntimeError(f"row {source_id} forked outside the end of its prefill")
        if len(set(ids)) != len(ids) or any(i in self._rows or s.prompt != specs[0].prompt for i, s in zip(ids, specs)):
            raise ValueError(f"rows {ids}: already open, or not one prompt")
        if specs and list(specs[0].prompt) != source.prompt:
            raise ValueError(f"a fork of row {source_id} must have its prompt")
        for spec in specs:  # (checked first: all or nothing)
            row = self._rows[spec.row_id] = self._new_row(spec)
            row.caches = [c.clone() for c in source.caches]
            row.processed, row.restored, row.quantized = source.processed, source.restored, source.quantized
            row.image = source.image  # (the source's embeddings and positions: its prompt)
        return [RowOpened(i, cached_tokens=source.restored, to_prefill=0) for i in ids]

    def _new_row(self, spec: RowSpec) -> Row:
        sampler = RowSampler.for_row(spec, protected_ids=self.protected, grammars=self.grammars)
        image = image_rows.open_state(self.model, spec)  # (ValueError: no vision tower, or bad runs)
        lora_rows = self.adapters.open(spec.adapters)  # (ValueError: one is not mounted)
        namespace = self.adapters.namespace(spec.adapters, spec.namespace)
        row = Row(spec.row_id, list(spec.prompt), sampler, max(1, spec.max_tokens), namespace=namespace)
        row.sampled = spec.resumed  # (a resumed row's RNG steps go on where it stopped)
        row.adapters, row.lora, row.image = spec.adapters, lora_rows, image
        row.convert_at = convert_at(self.kv_scheme, len(row.prompt), self.options.prefill_chunk)
        return row

    def join(self, row_id: int) -> TokenOut:
        row = self._rows[row_id]
        if row.processed != len(row.prompt) - 1:
            raise RuntimeError(f"row {row_id} joined before its prefill finished")
        last = mx.array(row.prompt[-1:])
        self.adapters.select([row.lora])
        hidden = self.model(last[None], row.caches, **image_rows.inputs(row, row.processed, row.processed + 1))
        row.processed += 1
        row.kv_length = row.processed
        row.quantized = quantize_due(self.kv_scheme, row.caches, row.processed, row.convert_at)
        if row.sampler.history_size:
            row.history = mx.array(row.prompt[-row.sampler.history_size :], dtype=mx.int32)
        token, lp, top = sample_row(row, self.model.logits(hidden[:, -1, :]))
        mx.eval(token, *([lp] if lp is not None else []), *(top or ()))
        out = record(row, cast(int, token.item()), lp, top, self.eos)
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
        deferred: list[Row] = []
        for row_id in row_ids:
            row = self._rows[row_id]
            if row.processed != len(row.prompt) - 1:
                raise RuntimeError(f"row {row_id} joined before its prefill finished")
            if row.sampler.constrained or row.image is not None:  # (an image row's last token: its embedding)
                outs.append(self.join(row_id))
                continue
            # The dispatch feeds last_token and, for penalty processors, appends it to history.
            row.last_token = row.prompt[-1]
            row.kv_length = row.processed
            if row.sampler.history_size:
                row.history = mx.array(
                    row.prompt[:-1][-row.sampler.history_size :], dtype=mx.int32
                )  # int even when empty
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
        if self.speculator is not None and not image_rows.decode_inputs(self._batch):  # (drafts: text rows only)
            return self.speculator.step(self, self._plain_step)
        return self._plain_step()

    def _plain_step(self) -> list[TokenOut]:
        if self._inflight is None:
            self._inflight = self._dispatch(mx.array([r.last_token for r in self._batch]))
        current = self._inflight
        self._inflight = self._dispatch(current.tokens)
        self._steps += 1
        if self.options.clear_cache and self._steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return read(current, self.eos)

    def close_row(self, row_id: int, *, reusable: bool = False, retain_s: float | None = None) -> None:
        self.aborts.discard(row_id)
        row = self._rows.pop(row_id, None)
        if row is None:
            return
        row.finished = True
        self.adapters.close(row.adapters)
        if reusable and self.prompt_cache is not None:
            try:
                self._put_row(row, retain_s)
            except Exception:
                # A failed put is a future cache miss; the row must still leave the batch.
                log.exception("prompt cache put for row %d failed", row_id)
        if row.in_batch:
            self._leave_batch(row)
        row.caches = []
        self._ready = [t for t in self._ready if t.row_id != row_id]

    def row_caches(self, row_id: int) -> list[KVCache]:
        """An open row's own caches (empty once it has joined the batch)."""
        return self._rows[row_id].caches

    def warm_up(self, max_batch: int, *, prompt_len: int = 8) -> None:
        """Meet serving's shapes on throwaway rows before serving (model/engine/warm_up.py)."""
        warm_up(self, max_batch, prompt_len=prompt_len)

    def mount_adapter(self, adapter_id: str, path: str) -> AdapterInfo:
        return self.adapters.mount(adapter_id, path)

    def unmount_adapter(self, adapter_id: str) -> bool:
        return self.adapters.unmount(adapter_id)  # False: once the rows using it close

    def prefill_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        return prefill_shapes(self.options, max_batch, GROUP_PAD_TOKENS)

    @property
    def active_rows(self) -> int:
        return len(self._rows)

    def live_kv_bytes(self) -> int:  # the open rows' KV now: the batch's, and rows' still prefilling
        return sum(c.nbytes for c in self._caches) + sum(c.nbytes for r in self._rows.values() for c in r.caches)

    @property
    def batch_size(self) -> int:
        return len(self._batch) - self._departed

    # -- prompt cache ----------------------------------------------------------------------------

    def _put_row(self, row: Row, retain_s: float | None = None) -> None:
        """Put a closing row's KV, keyed by exactly what it covers; called before it leaves."""
        batch = self._caches
        if not row.in_batch:
            caches = row.caches  # never joined (finished at token 0, or closed mid-prefill)
        elif _solo(batch):
            caches = batch  # the lone row holds the batch state: hand it over, no copy
        elif _merged(batch) and (len(row.prompt) >= MIN_CACHE_TOKENS or retain_s is not None):  # (preempted)
            i = self._batch.index(row)
            caches = [c.extract(i) for c in batch]
            # Materialize the copy now: a lazy slice would pin the whole batch buffer.
            mx.eval([c.state for c in caches])
        else:
            return
        assert self.prompt_cache is not None
        row_cache.put_covered(self.prompt_cache, self.kv_scheme, row, caches, retain_s)

    # -- batch membership --------------------------------------------------------------------

    def _admit_to_batch(self, rows: list[Row]) -> None:
        """Rows whose caches cover their prompt so far enter the batch: one merge, one extend."""
        self._settle_departures()
        if self._inflight is not None:
            # Settle the row set first: read the in-flight step and hold its tokens for `step`.
            self._ready.extend(read(self._inflight, self.eos))
            self._inflight = None
        joining = rows
        if not self._batch:
            self._caches, rows = rows[0].caches, rows[1:]  # adopt: one row runs the serial graph
        batch = self._caches
        if rows and _solo(batch):  # one row so far: its solo caches join the merge
            self._caches = merge_batch(self.kv_scheme, [batch, *(r.caches for r in rows)])
        elif rows and _merged(batch):
            for batch_cache, joining_cache in zip(batch, merge_batch(self.kv_scheme, [r.caches for r in rows])):
                batch_cache.extend(joining_cache)
        for row in joining:
            row.caches = []
            row.in_batch = True
            self._batch.append(row)

    def _leave_batch(self, row: Row) -> None:
        row.in_batch = False
        self._departed += 1
        if self._departed == len(self._batch):
            self._settle_departures()  # the batch is empty: free its KV now, not at a next step

    def _settle_departures(self) -> None:
        """Drop the rows closed since the last step from the batch: one filter for all."""
        if not self._departed:
            return
        self._departed = 0
        keep = [i for i, r in enumerate(self._batch) if r.in_batch]
        self._batch = [self._batch[i] for i in keep]
        if not self._batch:
            self._caches, self._inflight = [], None
            return
        batch = self._caches
        if _merged(batch):
            for cache in batch:
                cache.filter(keep)
            if len(self._batch) == 1:
                self._caches = [c.to_solo() for c in batch]
        if self._inflight is not None:
            self._inflight.keep(keep)

    # -- decode --------------------------------------------------------------------------------

    def _dispatch(self, inputs: mx.array) -> Inflight:
        """Start the decode step that feeds `inputs` ([B] tokens) to the batch's rows."""
        tokens = inputs[:, None]
        self.adapters.select([r.lora for r in self._batch])
        if self.kv_scheme.quantized:
            quantize_due_rows(self.kv_scheme, self._batch, self._caches)
        for row in self._batch:
            row.kv_length += 1
        if self._compiled is not None and self._compiled.ready():
            logits = self._compiled(tokens, self._caches)
        else:
            hidden = self.model(tokens, self._caches, **image_rows.decode_inputs(self._batch))
            logits = self.model.logits(hidden[:, -1, :])
        return sample_batch(list(self._batch), logits, inputs)
