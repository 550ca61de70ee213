"""The engine's rows, and the host side of a decode step: sampling logits, reading tokens back.

A step's tokens are sampled on the device and read one step later (the engine pipelines decode),
so a dispatched step is an `Inflight` until `read` turns it into `TokenOut`s.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, cast

import attrs
import mlx.core as mx

from model.engine.rows import TokenOut, TopLogprob
from model.engine.sampling import RowSampler, logprobs_of, observe_batch
from model.kv.cache import KVCache

if TYPE_CHECKING:
    from model.engine.image_rows import ImageState

# (ids, logprobs) of a row's top-k alternatives for one token.
TopK = tuple[mx.array, mx.array]


@attrs.define(eq=False)
class Row:
    row_id: int
    prompt: list[int]
    sampler: RowSampler
    max_tokens: int
    # The row's own caches while it prefills; empty once it is in the batch (or closed).
    caches: list[KVCache] = attrs.Factory(list)
    processed: int = 0  # prompt tokens whose KV is in the caches
    restored: int = 0  # of those, the ones restored from the prompt cache at open
    sampled: int = 0  # tokens whose sampling has been dispatched (drives the RNG step)
    generated: int = 0  # tokens read back and reported
    last_token: int = -1
    history: mx.array | None = None  # recent tokens, for penalty processors
    finished: bool = False
    in_batch: bool = False
    namespace: str = ""
    # (position, retention seconds or None), ascending: the prefill puts a clone of the caches at each.
    snapshots: list[tuple[int, float | None]] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)  # every generated token, in order (the put key's tail)
    aborted: bool = False  # a prefill forward stopped midway: its KV was dropped, the row only closes
    convert_at: int | None = None  # KV positions after which the row's caches turn quantized (None: never)
    quantized: bool = False  # they have
    kv_length: int = 0  # positions in the row's KV once it is in the batch (counts dispatched steps)
    draft: object = None  # a draft model's state for this row (model/engine/speculative_step.py)
    adapters: tuple[str, ...] = ()  # LoRA adapter ids (model/lora/adapters.py)
    lora: tuple[int, ...] = ()  # and the indices model/lora/mount.py selects them by
    image: ImageState | None = None  # a prompt with images: embeddings, positions (model/engine/image_rows.py)

    @property
    def key(self) -> list[int]:
        """The prompt as the prompt cache keys it (image runs replaced: model/engine/image_rows.py)."""
        return self.prompt if self.image is None else self.image.key


@attrs.define(eq=False)
class Inflight:
    """A dispatched decode step whose results have not been read yet."""

    rows: list[Row]
    tokens: mx.array  # [B]
    logprobs: list[mx.array | None]  # per row: logprob of the sampled token
    tops: list[TopK | None]  # per row: the top-k

    def keep(self, indices: list[int]) -> None:
        self.rows = [self.rows[i] for i in indices]
        self.tokens = self.tokens[mx.array(indices)]
        self.logprobs = [self.logprobs[i] for i in indices]
        self.tops = [self.tops[i] for i in indices]


def sample_row(row: Row, logits: mx.array) -> tuple[mx.array, mx.array | None, TopK | None]:
    """One row's next token from its [1, vocab] logits: (token [1], its logprob, top-k), lazily.
    A token the row's reasoning forces (model/engine/reasoning.py) replaces the sample; its
    logprob is still the model's."""
    logits = row.sampler.process(row.history, logits)
    logprobs = logprobs_of(logits)
    token = row.sampler.sample(logprobs, row.sampled)
    forced = row.sampler.forced(row.sampled - row.sampler.step_offset)
    if forced is not None:
        token = mx.array([forced], dtype=token.dtype)
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


def sample_batch(rows: list[Row], logits: mx.array, inputs: mx.array) -> Inflight:
    """Every row's next token from the batch's [B, vocab] logits (`inputs`: the [B] tokens that
    were fed), dispatched to the device without waiting for it."""
    positions = [r.sampled - r.sampler.step_offset for r in rows]  # each row's position being sampled
    waits = [r.sampler.needs_previous(p) for r, p in zip(rows, positions)]
    plain = (r.sampler.greedy and not r.sampler.params.logprobs and not r.sampler.params.top_logprobs for r in rows)
    if not any(waits) and all(plain):
        tokens = mx.argmax(logprobs_of(logits), axis=-1)
        for r in rows:
            r.sampled += 1
        inflight = Inflight(rows, tokens, [None] * len(rows), [None] * len(rows))
    else:
        if any(waits):
            # Grammar rows (and a row whose reasoning may end here) need their previous token on
            # the host: start this forward, read the (already dispatched) inputs, and let the
            # matchers catch up and fill their masks while the device runs it. inputs[i] is row
            # i's token at position positions[i] - 1.
            mx.async_eval(logits)
            observe_batch([r.sampler for r in rows], [p - 1 for p in positions], cast(list[int], inputs.tolist()))
        per_row = []
        for i, r in enumerate(rows):
            if r.sampler.history_size:
                assert r.history is not None  # set when the row joined
                r.history = mx.concatenate([r.history, inputs[i : i + 1]])[-r.sampler.history_size :]
            per_row.append(sample_row(r, logits[i : i + 1]))
        tokens = mx.concatenate([t for t, _, _ in per_row])
        inflight = Inflight(rows, tokens, [lp for _, lp, _ in per_row], [top for _, _, top in per_row])
    mx.async_eval(
        inflight.tokens,
        *[lp for lp in inflight.logprobs if lp is not None],
        *[a for top in inflight.tops if top is not None for a in top],
    )
    return inflight


def read(inflight: Inflight, eos: Collection[int]) -> list[TokenOut]:
    """Wait for a dispatched step and record its tokens (rows finished meanwhile are skipped)."""
    tokens = cast(list[int], inflight.tokens.tolist())  # (a [B] integer array)
    outs = []
    for row, token, lp, top in zip(inflight.rows, tokens, inflight.logprobs, inflight.tops):
        if row.finished:
            continue  # computed ahead by the pipeline after the row ended
        outs.append(record(row, token, lp, top, eos))
    return outs


def record(row: Row, token: int, lp: mx.array | None, top: TopK | None, eos: Collection[int]) -> TokenOut:
    """A token read back for `row`: appended to it, finishing it on EOS or at max_tokens, or
    failing it ("error") once its grammar has failed."""
    # The grammar sees the token now if the pipeline has not shown it already (idempotent).
    row.sampler.observe(row.generated, token)
    row.generated += 1
    row.last_token = token
    row.tokens.append(token)
    finish = error = None
    grammar = row.sampler.grammar
    if grammar is not None and grammar.failed:
        # A failed matcher allows only EOS: ending with "stop" would pass the text so far off
        # as a complete, valid output.
        finish = "error"
        error = f"the output constraint failed during generation: {grammar.failure or grammar.error or 'rejected'}"
    elif token in eos:
        finish = "stop"
    elif row.generated >= row.max_tokens:
        finish = "length"
    row.finished = finish is not None
    top_list: tuple[TopLogprob, ...] = ()
    if top is not None:
        ids, values = cast(list[int], top[0].tolist()), cast(list[float], top[1].tolist())
        pairs = sorted(zip(ids, values), key=lambda p: -p[1])
        top_list = tuple(TopLogprob(i, v) for i, v in pairs)
    logprob = None if lp is None else float(cast(float, lp.item()))
    return TokenOut(row.row_id, token, finish, logprob=logprob, top_logprobs=top_list, error=error)
