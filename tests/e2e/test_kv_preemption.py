"""The live-KV budget on a real engine: a burst whose KV is ~5x the budget all finishes, the live
KV never passes the budget, and every output equals its solo run, preempted rows' included."""

from __future__ import annotations

import pytest
import trio

from actors.kv_memory import GROWTH_TOKENS
from tests.realserver import Streamed, complete, real_server

LIMIT_S = 300
REQUESTS = 24
MAX_TOKENS = 300
WORDS = "the quick brown fox jumps over the lazy dog while an old fisherman mends his nets by the sea".split()


def prompt_text(i: int) -> str:
    return f"Agent {i}: " + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(150 + i))


@pytest.mark.slow  # (~14 s on 2 cores; the MockClock tests in tests/actors/test_kv_budget.py run by default)
async def test_a_burst_five_times_the_kv_budget_finishes_within_it_and_equals_solo_runs(qwen3_dir):
    bodies = [{"prompt": prompt_text(i), "max_tokens": MAX_TOKENS, "temperature": 0} for i in range(REQUESTS)]
    # A budget that opens 7 rows of up to 2 growth steps each: as they pass 512 positions the
    # batch no longer fits and rows are preempted.
    with trio.fail_after(LIMIT_S):
        async with real_server(qwen3_dir, batch=32, prompt_cache_bytes=256 << 20, eos_token_ids=()) as probe:
            per_token = probe.handles.info.kv_bytes_per_token
            lengths = [len(probe.tokenizer.encode(prompt_text(i))) for i in range(REQUESTS)]
        budget = 7 * 2 * GROWTH_TOKENS * per_token
        total = sum(-(-(n + MAX_TOKENS) // GROWTH_TOKENS) * GROWTH_TOKENS * per_token for n in lengths)
        assert total >= 4.5 * budget  # the burst's KV together is ~5x the budget
        assert all(GROWTH_TOKENS < n + 1 and n + MAX_TOKENS > 2 * GROWTH_TOKENS for n in lengths)
        async with real_server(
            qwen3_dir, batch=32, prompt_cache_bytes=256 << 20, eos_token_ids=(), kv_budget_gb=budget / 1e9
        ) as server:
            solo = [await complete(server, body) for body in bodies]
            assert server.handles.scheduler.counters.preemptions == 0  # one row alone never is
            burst: dict[int, Streamed] = {}

            async def one(i: int) -> None:
                burst[i] = await complete(server, bodies[i])

            async with trio.open_nursery() as nursery:
                for i in range(REQUESTS):
                    nursery.start_soon(one, i)
            stats = await server.stats()
    batch = stats["batch"]
    assert batch["kv_budget_bytes"] == int(budget)
    assert batch["preemptions"] >= 1 and batch["resumes"] == batch["preemptions"]
    assert 0 < batch["peak_kv_bytes"] <= batch["kv_budget_bytes"]
    for i in range(REQUESTS):
        assert burst[i].finish_reason == "length" and burst[i].done, i
        assert burst[i].text == solo[i].text, i
