"""`--paged-kv` on a real server: requests decoding together in a paged batch (rows of different
lengths joining and leaving) stream exactly their solo texts, /stats says the KV is paged, and
the scheduler bills the batch by each row's own blocks."""

from __future__ import annotations

import trio

from model.kv import paged
from tests.realserver import Streamed, complete, real_server

WORDS = "the quick brown fox jumps over the lazy dog while an old fisherman mends his nets by the sea".split()


def body(i: int) -> dict:
    text = f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(20 + 90 * (i % 3)))
    return {"prompt": text, "max_tokens": 16 + 8 * i, "temperature": 0}


async def test_a_paged_batch_streams_each_requests_solo_text(qwen3_dir, monkeypatch):
    writes: list[int] = []
    real = paged.PagedBatchKVCache._write

    def spy(self, keys, values):  # type: ignore[no-untyped-def]
        writes.append(keys.shape[0])
        return real(self, keys, values)

    monkeypatch.setattr(paged.PagedBatchKVCache, "_write", spy)
    bodies = [body(i) for i in range(6)]
    with trio.fail_after(120):
        async with real_server(qwen3_dir, batch=8, eos_token_ids=(), paged_kv=True) as server:
            assert server.handles.scheduler.kv_budget.paged  # (the auto budget, billed per row)
            solo = [await complete(server, b) for b in bodies]
            assert not writes  # one row at a time: its own solo caches
            together: dict[int, Streamed] = {}

            async def one(i: int) -> None:
                together[i] = await complete(server, bodies[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(bodies)):
                    nursery.start_soon(one, i)
            stats = await server.stats()
    assert stats["kv_quant"]["paged"] is True
    assert writes and max(writes) > 1  # rows decoded together in a paged batch
    for i in range(len(bodies)):
        assert together[i].finish_reason == "length" and together[i].text == solo[i].text, i
