"""The live-KV budget: what every row holding KV takes together, what a new row needs, and which
row is preempted when the running rows' growth would pass the budget. Pure rules, no trio.

Admission checks each request against the memory budget on its own; this is the other half: the
scheduler opens a row only while the rows already holding KV and the new row's next growth fit
`budget_bytes`, and before a decode step whose growth would not fit it preempts the running row
that arrived last (vLLM's choice: the newest work is redone, the oldest finishes), putting its KV
in the prompt cache so it resumes as a cache hit with exactly the tokens it would have produced.

A row's bill is its positions rounded up to the KV buffers' growth step (they grow 256 positions
at a time), at the scheme's true bytes (`kv_bill`: a quantized row past its conversion point at
the quantized rate), plus a hybrid model's fixed recurrent state per row; a contiguous batch holds
every row padded to its longest, so the rows together cost their count times the longest one's
bill. Under `--paged-kv` each row holds its own 256-position blocks (model/kv/paged.py): the rows
together cost the sum of their own bills.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from actors.policy import GROWTH_TOKENS, KvRate, kv_bill
from model.engine.rows import RowSpec

if TYPE_CHECKING:
    from actors.worker_api import ModelInfo

PREEMPT_RETAIN_S = 600.0  # a preempted row's KV is protected in the prompt cache this long
# MLX keeps freed buffers for reuse; unbounded, it keeps every transient a burst ever made. Twice
# one prefill forward's peak lets each forward reuse the last one's buffers.
BUFFER_CACHE_FLOOR = 1 << 30


def buffer_cache_bytes(prefill_transient_bytes: int) -> int:
    """The bound on MLX's buffer cache (`mx.set_cache_limit`); it is emptied when the server idles."""
    return max(BUFFER_CACHE_FLOOR, 2 * prefill_transient_bytes)


@attrs.frozen
class KvBudget:
    budget_bytes: int
    rate: KvRate
    paged: bool = False  # rows hold blocks of their own (`ModelInfo.kv_paged`), not a padded batch

    def row_bytes(self, tokens: int) -> int:
        """What a row of `tokens` positions holds: whole growth steps, plus its fixed state."""
        held = -(-max(0, tokens) // GROWTH_TOKENS) * GROWTH_TOKENS
        rate = self.rate
        kv = kv_bill(
            held,
            kv_bytes_per_token=rate.bytes_per_token,
            kv_quant_ratio=rate.quant_ratio,
            kv_quantized_from=rate.quantized_from,
        )
        return kv + rate.state_bytes_per_row

    def batch_bytes(self, rows: int, longest: int) -> int:
        """A contiguous batch of `rows` rows holds each padded to its `longest` (model/kv/cache.py)."""
        return rows * self.row_bytes(longest)

    def rows_bytes(self, positions: Sequence[int]) -> int:
        """What rows of these `positions` hold as one batch: each padded to the longest, or,
        paged, each its own blocks (whole growth steps: a block is one)."""
        if not positions:
            return 0
        if self.paged:
            return sum(self.row_bytes(p) for p in positions)
        return self.batch_bytes(len(positions), max(positions))


def kv_budget(budget_bytes: int, info: ModelInfo) -> KvBudget:
    """The live-KV budget of `budget_bytes`, billed at the loaded model's rates."""
    rate = KvRate(info.kv_bytes_per_token, info.kv_quant_ratio, info.kv_quantized_from, info.state_bytes_per_row)
    return KvBudget(budget_bytes, rate, paged=info.kv_paged)


def preemptible(spec: RowSpec) -> bool:
    """A row the scheduler may preempt, on a model whose KV comes back exactly (`ModelInfo.
    preemptible`): not grammar-constrained (the matcher's state lives on the worker) and without
    images (their features would be encoded again)."""
    return spec.sampling.constraint is None and not spec.images


def resumed_spec(spec: RowSpec, generated: Sequence[int]) -> RowSpec:
    """The row a preempted one resumes as: its prompt ends with what it generated, its sampler's
    steps go on from there (`RowSpec.resumed`), and it may generate what is left."""
    return attrs.evolve(
        spec,
        prompt=spec.prompt + tuple(generated),
        max_tokens=spec.max_tokens - len(generated),
        resumed=spec.resumed + len(generated),
    )
