"""Real-engine serving tests on tiny random-weight models, an agent chat replay among them.

Everything is real except the socket: the GPU worker's MLX thread, the scheduler, admission, the
request actors and the quart-trio app, driven through quart-trio's test client. A thin
`RecordingWorker` (tests/realserver.py) sits between the scheduler and the real worker and logs every
call, so the tests can check token ids per row and the order of worker calls.

Real threads: the real clock with generous `trio.fail_after` limits, never `autojump_clock`.
"""

from __future__ import annotations

import pytest
import trio

from tests.realserver import (
    RealServer,
    Streamed,
    complete,
    real_server,
    stream,
    wait_until,
)

LIMIT_S = 120  # a hang fails the test; a slow shared CI core does not

WORDS = (
    "the quick brown fox jumps over the lazy dog once upon a time in a small village by the sea "
    "there lived an old fisherman and his wife every morning he walked down to the harbour"
).split()


def prompt_text(i: int, words: int = 6) -> str:
    """Distinct prompts of different lengths."""
    return f"Request {i}: " + " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(words + i))


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def row_tokens(server: RealServer, prompt_text_: str) -> list[list[int]]:
    """Token ids the worker produced for every row whose prompt encodes `prompt_text_`."""
    prompt = tuple(server.tokenizer.encode(prompt_text_))
    by_row = server.worker.tokens_by_row()
    return [by_row.get(rid, []) for rid in server.worker.row_for_prompt(prompt)]


async def solo_runs(server: RealServer, bodies: list[dict]) -> list[Streamed]:
    """Each request alone (one after another): the B=1 path."""
    out = []
    for body in bodies:
        out.append(await complete(server, body))
        assert server.handles.scheduler.active_rows == 0
    return out


# -- a. 8 concurrent greedy requests each equal their solo output ---------------------------------


@pytest.mark.parametrize("group_prefill,cache", [("off", 0), ("on", 0), ("on", 64 << 20)])
async def test_eight_concurrent_greedy_requests_equal_their_solo_outputs(model_dir, group_prefill, cache):
    # With the prompt cache on, the solo runs leave every prompt cached: a row opened for a group
    # ignores a hit that short (GROUP_MIN_CACHED_TOKENS), so the burst is still prefilled together.
    bodies = [{"prompt": prompt_text(i), "max_tokens": 24, "temperature": 0} for i in range(8)]
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=8, group_prefill=group_prefill, prompt_cache_bytes=cache) as server:
            solo = await solo_runs(server, bodies)
            assert max(server.worker.step_widths()) == 1
            solo_steps = len(server.worker.step_widths())
            concurrent: dict[int, Streamed] = {}

            async def one(i: int) -> None:
                concurrent[i] = await complete(server, bodies[i])

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
            widths = server.worker.step_widths()[solo_steps:]
            # Rows close one worker call at a time after their last token went out.
            while (stats := await server.stats())["batch"]["finished_rows"] < 16:
                await trio.sleep(0.01)

    # The concurrent run really was one B=8 batch, not eight B=1 runs in a row.
    assert max(widths) == 8, widths
    for i, body in enumerate(bodies):
        assert solo[i].finish_reason == concurrent[i].finish_reason == "length"
        assert solo[i].usage["completion_tokens"] == concurrent[i].usage["completion_tokens"] == 24
        assert concurrent[i].text == solo[i].text, f"request {i}"
        ids = row_tokens(server, body["prompt"])
        assert len(ids) == 2 and len(ids[0]) == 24 and ids[0] == ids[1], f"request {i}: {ids}"
    assert len({r.text for r in solo}) == 8  # distinct prompts, distinct answers: the check has teeth
    assert stats["batch"]["active_rows"] == 0 and stats["batch"]["finished_rows"] == 16
    groups = [c.result for c in server.worker.calls if c.name == "prefill_group"]
    if group_prefill == "on":  # the arrivals that met in the queue were prefilled and joined together
        assert groups and stats["batch"]["group_prefills"] == len(groups), stats["batch"]
        joined = [c.result for c in server.worker.calls if c.name == "join_group"]
        assert sum(len(j) for j in joined) >= 2
    else:
        assert not groups and stats["batch"]["group_prefills"] == 0


# -- b. aborting half mid-stream leaves the other half exact and the server healthy --------------


async def test_aborting_half_mid_stream_leaves_the_rest_exact_and_the_server_healthy(model_dir):
    keep = [{"prompt": prompt_text(i), "max_tokens": 48, "temperature": 0} for i in range(4)]
    leave = [{"prompt": prompt_text(10 + i), "max_tokens": 400, "temperature": 0} for i in range(4)]
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, batch=8) as server:
            solo = await solo_runs(server, keep)
            kept: dict[int, Streamed] = {}
            cut: dict[int, Streamed] = {}

            async def keeper(i: int) -> None:
                kept[i] = await stream(server, keep[i])

            async def leaver(i: int) -> None:
                cut[i] = await stream(server, leave[i], cut_after=4)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(keeper, i)
                    nursery.start_soon(leaver, i)
            await wait_until(lambda: server.handles.scheduler.active_rows == 0)
            # active_rows drops when a row leaves the table, just before its close_row job runs.
            await wait_until(server.worker.settled)
            status, body = await server.health()
            stats = await server.stats()
            engine_rows = await server.worker.run_exclusive(lambda engine: engine.active_rows)
            # The server still serves, exactly, after the aborts.
            again = await complete(server, keep[0])

    calls = server.worker.calls
    for i in range(4):
        assert cut[i].cut and cut[i].finish_reason is None and not cut[i].done
        [leaver_row] = server.worker.row_for_prompt(tuple(server.tokenizer.encode(leave[i]["prompt"])))
        produced = server.worker.tokens_by_row()[leaver_row]
        assert len(produced) < 400  # it left long before its max_tokens
        [close] = [c for c in calls if c.name == "close_row" and c.row_id == leaver_row]
        # ... mid-stream: the keepers were still decoding after it was closed.
        keeper_steps_after = [c for c in calls[close.seq :] if c.name == "step" and len(c.result) >= 2]
        assert keeper_steps_after, f"leaver {i} was not aborted while the keepers ran"
    for i in range(4):
        assert kept[i].finish_reason == "length" and kept[i].done
        assert kept[i].text == solo[i].text, f"keeper {i}"
        ids = row_tokens(server, keep[i]["prompt"])
        assert len(ids) == (3 if i == 0 else 2) and len(ids[0]) == 48, f"keeper {i}"
        assert all(run == ids[0] for run in ids), f"keeper {i}"
    assert again.text == solo[0].text
    assert (status, body) == (200, b'{"status": "ok"}')
    assert stats["batch"]["active_rows"] == 0 and stats["batch"]["pending_rows"] == 0
    assert stats["batch"]["aborted_rows"] == 4 and stats["batch"]["failed_rows"] == 0
    assert stats["admission"]["in_flight"] == 0
    assert engine_rows == 0  # every aborted row's KV was released in the engine too


# -- c. a seeded request in a running batch: tests/e2e/test_seeded_batch.py -------------------------


# -- d. a long-prompt joiner stalls running streams by at most one prefill chunk -----------------


@pytest.mark.parametrize("prefill_chunk, decoding_chunk", [(16, 0), (64, 16)], ids=["full-chunk", "decoding-chunk"])
async def test_long_prompt_joiner_interleaves_its_chunks_with_decode_steps(model_dir, prefill_chunk, decoding_chunk):
    """With --decoding-prefill-chunk the joiner's chunks beside running rows are that size (the
    worker's own chunk otherwise), and its output equals the same prompt prefilled alone."""
    chunk = decoding_chunk or prefill_chunk
    running = [{"prompt": prompt_text(i), "max_tokens": 120, "temperature": 0} for i in range(3)]
    long_prompt = " ".join(WORDS[k % len(WORDS)] for k in range(120))
    with trio.fail_after(LIMIT_S):
        async with real_server(
            model_dir, batch=8, prefill_chunk=prefill_chunk, decoding_prefill_chunk=decoding_chunk
        ) as server:
            long_ids = server.tokenizer.encode(long_prompt)
            results: dict[int, Streamed] = {}

            async def one(i: int, body: dict) -> None:
                results[i] = await stream(server, body)

            async with trio.open_nursery() as nursery:
                for i, body in enumerate(running):  # staggered: each joins a running batch
                    nursery.start_soon(one, i, body)
                    await wait_until(lambda: len(server.handles.scheduler.table.running) == i + 1)
                await wait_until(lambda: server.worker.step_widths().count(3) >= 3)  # all three stream
                nursery.start_soon(one, 99, {"prompt": long_prompt, "max_tokens": 8, "temperature": 0})
            alone = await complete(server, {"prompt": long_prompt, "max_tokens": 8, "temperature": 0})

    long_row, alone_row = server.worker.row_for_prompt(tuple(long_ids))
    alone_calls = [c for c in server.worker.calls if c.row_id == alone_row]
    calls = server.worker.calls[: alone_calls[0].seq]  # the concurrent phase
    assert len([c for c in alone_calls if c.name == "prefill"]) == -(-(len(long_ids) - 1) // prefill_chunk)
    assert alone.text == results[99].text
    by_row = server.worker.tokens_by_row()
    assert by_row[long_row] == by_row[alone_row]
    chunks = [c for c in calls if c.name == "prefill" and c.row_id == long_row]
    # into a running batch with nobody queued, the joiner rides the next step (join_group)
    [join] = [c for c in calls if c.name in ("join", "join_group") and c.row_id == long_row]
    # The prompt needs many chunks ...
    assert len(long_ids) - 1 > 10 * chunk and len(chunks) == -(-(len(long_ids) - 1) // chunk)
    # ... and between any two decode steps at most one forward (a chunk or a join) ran.
    steps = [c.seq for c in calls if c.name == "step"]
    between = [[c.name for c in calls[a + 1 : b] if c.name in ("prefill", "join")] for a, b in zip(steps, steps[1:])]
    assert max(len(b) for b in between) <= 1, [b for b in between if len(b) > 1]
    # While the long joiner prefilled, the three streams kept stepping after every chunk.
    during = [c for c in calls[chunks[0].seq : join.seq] if c.name == "step"]
    assert len(during) >= len(chunks) and all(len(c.result) == 3 for c in during)
    for i in range(3):
        assert results[i].finish_reason == "length" and results[i].usage["completion_tokens"] == 120
    assert results[99].finish_reason == "length" and results[99].usage["completion_tokens"] == 8


# -- e. a 10-turn agent chat hits the prompt cache every turn and matches a cold server --


async def replay_chat(server: RealServer, system: str, turns: int) -> list[tuple[list[dict], Streamed]]:
    """An agent's loop: the full history every turn, each reply appended exactly as returned."""
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: tell me about the {WORDS[turn]}"})
        result = await stream(server, {"messages": messages, "max_tokens": 8, "temperature": 0}, chat=True)
        assert result.done and result.finish_reason in ("stop", "length"), result
        out.append(([dict(m) for m in messages], result))
        messages.append({"role": "assistant", "content": result.text})
    return out


async def test_ten_turn_agent_chat_hits_the_prompt_cache_and_matches_a_cold_server(model_dir):
    from cache.boundary import stable_prefix_length
    from model.engine.engine import MIN_CACHE_TOKENS

    system = "You are a helpful assistant. " + " ".join(WORDS[k % len(WORDS)] for k in range(120))
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, prompt_cache_bytes=64 << 20) as warm:
            warm_turns = await replay_chat(warm, system, 10)
            warm_stats = await warm.stats()
        async with real_server(model_dir, prompt_cache_bytes=0) as cold:
            cold_turns = await replay_chat(cold, system, 10)
            cold_stats = await cold.stats()

    first_prompt = warm_turns[0][1].usage["prompt_tokens"]
    assert first_prompt >= MIN_CACHE_TOKENS  # long enough for a boundary snapshot
    assert warm_turns[0][1].usage["prompt_tokens_details"]["cached_tokens"] == 0
    for turn in range(1, 10):
        (prev_messages, prev), (_, now) = warm_turns[turn - 1], warm_turns[turn]
        cached = now.usage["prompt_tokens_details"]["cached_tokens"]
        prev_prompt = warm.tokenizer.encode_chat(prev_messages, add_generation_prompt=True)
        stable = min(
            stable_prefix_length(warm.tokenizer, prev_messages, prompt_tokens=prev_prompt), len(prev_prompt) - 1
        )
        assert stable >= MIN_CACHE_TOKENS
        assert cached >= stable, f"turn {turn + 1}: cached {cached} < previous stable prefix {stable}"
        assert cached >= prev.usage["prompt_tokens"], f"turn {turn + 1} did not reuse the previous prompt"
        assert cached < now.usage["prompt_tokens"]  # at least one token is always forwarded
    for turn, ((_, hot), (_, cool)) in enumerate(zip(warm_turns, cold_turns)):
        assert cool.usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert hot.usage["prompt_tokens"] == cool.usage["prompt_tokens"], f"turn {turn + 1}"
        assert hot.text == cool.text and hot.finish_reason == cool.finish_reason, f"turn {turn + 1}"
    # Token ids too, not just text: every warm row produced exactly what its cold twin did.
    warm_ids = [warm.worker.tokens_by_row()[rid] for rid in sorted(warm.worker.specs)]
    cold_ids = [cold.worker.tokens_by_row()[rid] for rid in sorted(cold.worker.specs)]
    assert warm_ids == cold_ids and len(warm_ids) == 10
    pc = warm_stats["prompt_cache"]
    assert pc["enabled"] and pc["hits"] >= 9 and pc["entries"] > 0 and 0 < pc["bytes"] <= pc["max_bytes"]
    assert cold_stats["prompt_cache"]["enabled"] is False
