"""A seeded request rides the running batch and still gives its solo output (real tiny engine).

Each row samples from its own (seed, step) key (model/engine/sampling.py), so placement no longer sends a
seeded request to the serial lane to wait for the batch to drain. Real threads: the real clock
with a generous `trio.fail_after`, never `autojump_clock`.
"""

from __future__ import annotations

import pytest
import trio

from tests.realserver import RealServer, Streamed, complete_whole, real_server, stream, wait_until

LIMIT_S = 120  # a hang fails the test; a slow shared CI core does not
LONG_TOKENS = 400  # the running rows' length: far longer than the seeded one's 24 tokens

WORDS = (
    "the quick brown fox jumps over the lazy dog once upon a time in a small village by the sea "
    "there lived an old fisherman and his wife every morning he walked down to the harbour"
).split()


def prompt_text(i: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(8 + i))


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def row_tokens(server: RealServer, text: str) -> list[list[int]]:
    """Token ids the worker produced for every row whose prompt encodes `text`, in row order."""
    by_row = server.worker.tokens_by_row()
    return [by_row.get(rid, []) for rid in server.worker.row_for_prompt(tuple(server.tokenizer.encode(text)))]


async def test_a_seeded_sampling_request_joins_a_running_batch_and_equals_its_solo_run(model_dir):
    seeded = {"prompt": prompt_text(3), "max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 7}
    long_rows = [{"prompt": prompt_text(10 + i), "max_tokens": LONG_TOKENS, "temperature": 0.9} for i in range(3)]
    with trio.fail_after(LIMIT_S):
        # No EOS: every row runs to its max_tokens, so the long rows are surely still decoding.
        async with real_server(model_dir, batch=8, eos_token_ids=()) as server:
            alone = await complete_whole(server, seeded)
            other_seed = await complete_whole(server, {**seeded, "seed": 8})
            long_results: dict[int, Streamed] = {}
            at_first_token: list[tuple[int, list[int]]] = []  # (rows running, long rows' chunks so far)

            async def long_row(i: int) -> None:
                long_results[i] = Streamed()
                long_results[i] = await stream(server, long_rows[i])

            def first_token(result: Streamed) -> None:
                if result.chunks == 1:
                    chunks = [long_results[i].chunks for i in range(3)]
                    at_first_token.append((len(server.handles.scheduler.table.running), chunks))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(long_row, i)
                await wait_until(lambda: len(server.handles.scheduler.table.running) == 3)
                under_load = await stream(server, seeded, on_chunk=first_token)
                long_done_when_seeded_ended = [long_results[i].done for i in range(3)]
            stats = await server.stats()

    assert alone["usage"]["lane"] == "batched" and alone["usage"]["completion_tokens"] == 24
    assert under_load.text == alone["choices"][0]["text"]
    ids = row_tokens(server, seeded["prompt"])
    assert len(ids) == 3 and ids[0] == ids[2] != ids[1]  # seed 7 alone == seed 7 in the batch != seed 8
    assert len(ids[2]) == 24
    assert other_seed["choices"][0]["text"] != alone["choices"][0]["text"]  # the seed drives the sampling
    # It started while the batch was busy: at its first token the 3 long rows were still running
    # (none drained, each far from its 400 tokens) and the seeded row was running beside them.
    (running, long_chunks) = at_first_token[0]
    assert running == 4 and all(chunks < LONG_TOKENS for chunks in long_chunks)
    assert not any(long_done_when_seeded_ended)
    assert max(server.worker.step_widths()) == 4  # it decoded in the same steps as the long rows
    assert all(long_results[i].done for i in range(3))
    assert [len(row_tokens(server, row["prompt"])[0]) for row in long_rows] == [LONG_TOKENS] * 3
    assert stats["batch"]["active_rows"] == 0
