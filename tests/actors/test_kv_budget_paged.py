"""The live-KV budget under `--paged-kv` (MockClock, fake worker): a paged batch's rows are billed
by the blocks each holds, not padded to the longest row, so a short row opens beside a long one
where a contiguous batch's bill would make it wait; the bill reaches the budget from the model's
info."""

from __future__ import annotations

import attrs
import trio

from actors.kv_memory import GROWTH_TOKENS, KvBudget, kv_budget
from actors.policy import KvRate
from tests.fakes import FakeWorker, scheduler_harness


def budget(tokens: int, *, paged: bool) -> KvBudget:
    """A budget of `tokens` positions (one byte each)."""
    return KvBudget(tokens, KvRate(bytes_per_token=1), paged=paged)


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(10 + salt + i for i in range(n))


def test_paged_rows_are_billed_their_own_blocks_contiguous_ones_the_longest():
    positions = [1000, 10, 300]
    assert budget(0, paged=False).rows_bytes(positions) == 3 * 1024
    assert budget(0, paged=True).rows_bytes(positions) == 1024 + GROWTH_TOKENS + 512
    assert budget(0, paged=True).rows_bytes([]) == budget(0, paged=False).rows_bytes([]) == 0
    # A hybrid model's fixed state is every row's, either way.
    state = KvBudget(0, KvRate(bytes_per_token=1, state_bytes_per_row=7), paged=True)
    assert state.rows_bytes([1, 257]) == 256 + 512 + 2 * 7


def test_the_models_info_says_whether_its_rows_are_paged():
    info = FakeWorker().info
    assert not kv_budget(1 << 20, info).paged
    assert kv_budget(1 << 20, attrs.evolve(info, kv_paged=True)).paged


async def test_a_short_row_opens_beside_a_long_one_only_when_paged(autojump_clock):
    async def second_waits(paged: bool) -> bool:
        worker = FakeWorker(chunk=2048)
        async with scheduler_harness(worker, kv_budget=budget(2048, paged=paged)) as h:
            long = h.submit(1, prompt(1000), max_tokens=10)
            await trio.sleep(0.5)
            short = h.submit(2, prompt(10, salt=1), max_tokens=10)
            await trio.sleep(60)
        assert long.tokens == worker.expected(prompt(1000), 10)
        assert short.tokens == worker.expected(prompt(10, salt=1), 10)
        assert not worker.violations
        second_opened = [t for t, call, arg in worker.calls if call == "open_row" and arg == 2][0]
        return second_opened >= worker.closed[1][0]

    # With their next growth: contiguous 2 x 1280 > 2048, the short row waits for the long one;
    # paged 1280 + 512 fits, it opens beside it.
    assert await second_waits(paged=False)
    assert not await second_waits(paged=True)
