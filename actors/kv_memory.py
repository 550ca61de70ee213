"""The live-KV budget: what every row holding KV takes together, what a new row needs, and which
row is preempted when the running rows' growth would pass the budget. Pure rules, no trio.

Admission checks each request against the memory budget on its own; this is the other half: the
scheduler opens a row only while the rows already holding KV and the new row's next growth fit
`budget_bytes`, and before a decode step whose growth would not fit it preempts the running row
that arrived last (vLLM's choice: the newest work is redone, the oldest finishes), putting its KV
in the prompt cache so it resumes as a cache hit with exactly the tokens it would have produced.

A row's bill is its positions rounded up to the KV buffers' growth step (they grow 256 positions
at a time), at the scheme's true bytes (`kv_bill`: a quantized row past its conversion point at
the quantized rate), plus a hybrid model's fixed recurrent state per row; a batch holds every row
padded to its longest, so the rows together cost their count times the longest one's bill.
"""

from __future__ import annotations

import attrs

from actors.policy import KvRate, kv_bill

GROWTH_TOKENS = 256  # KV buffers grow by this many positions (model/kv/cache.py STEP)
PREEMPT_RETAIN_S = 600.0  # a preempted row's KV is protected in the prompt cache this long


@attrs.frozen
class KvBudget:
    budget_bytes: int
    rate: KvRate

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
        """A batch of `rows` rows holds each padded to its `longest` (model/kv/cache.py)."""
        return rows * self.row_bytes(longest)
