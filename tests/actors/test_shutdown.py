"""Shutdown order on virtual time: admission closed → in-flight finished or cut cleanly →
HTTP done → actors stopped → flush → return. The HTTP server is a double that behaves like
hypercorn's `serve` (trigger → stop accepting → wait for in-flight up to the graceful timeout)."""

from __future__ import annotations

import json

import trio

from tests.fakes import FakeWorker
from tests.helpers.http import post_stream
from tests.helpers.shutdown import names, order_is, run, streamer


async def late_request(note, http):
    await trio.sleep(2.5)  # after the signal
    response = await http.post("/v1/completions", json={"prompt": "a"})
    note(("late request", response.status_code))


async def test_clean_shutdown_finishes_in_flight_then_flushes(autojump_clock):
    worker = FakeWorker()  # join 1 s + 1 s per step: 5 tokens end at t=5
    events = await run(worker, [streamer(5), late_request], timeout=30, signals_at=[2])
    times = {name: t for (t, _), name in zip(events, names(events))}
    ended = next(what for _, what in events if what[0] == "stream ended")
    assert ended == ("stream ended", "[DONE]", "length", 5)  # finished in full
    assert ("late request", 503) in [what for _, what in events]
    assert order_is(
        events,
        "signal",
        "admission closed",
        "stream ended",
        "http done",
        "actors stopped",
        "flush",
        "flushed",
        "returned",
    )
    assert times["stream ended"] == 5 and times["returned"] == 5.5


async def test_timed_out_shutdown_cuts_streams_cleanly_then_flushes(autojump_clock):
    worker = FakeWorker()
    events = await run(worker, [streamer(100)], timeout=3, signals_at=[2])
    times = {name: t for (t, _), name in zip(events, names(events))}
    _, done, reason, tokens = next(what for _, what in events if what[0] == "stream ended")
    assert (done, reason) == ("[DONE]", "abort") and tokens < 100  # a final chunk, not a cut
    assert times["stream ended"] == 5  # signal + --shutdown-timeout
    assert order_is(
        events, "signal", "admission closed", "stream ended", "http done", "actors stopped", "flush", "returned"
    )
    # Nothing waits for the aborted row's step boundary: the actors stop as soon as HTTP is done.
    assert times["http done"] == times["actors stopped"] == 5
    assert not worker.violations


async def test_second_signal_exits_at_once(autojump_clock):
    events = await run(FakeWorker(), [streamer(100)], timeout=30, signals_at=[2, 2.5])
    times = {name: t for (t, _), name in zip(events, names(events))}
    assert order_is(events, "signal", "hard cancel", "actors stopped", "flush", "returned")
    assert times["hard cancel"] == 2.5 and times["returned"] == 3.0  # only the flush's own 0.5 s


async def test_signal_during_model_load_stops_without_serving(autojump_clock):
    class SlowLoad(FakeWorker):
        async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
            await trio.sleep(10)
            await super().run(task_status=task_status)

    events = await run(SlowLoad(), [], timeout=30, signals_at=[1])
    times = {name: t for (t, _), name in zip(events, names(events))}
    # The port was bound before the load; the signal stops the load and closes it at once.
    assert "serving" not in names(events)
    assert order_is(events, "listening", "signal", "listeners closed", "http done", "actors stopped", "returned")
    assert times["actors stopped"] == 1.0  # then the flush hook's own 0.5 s


def cut_client(path, body, final_of):
    """A client whose answer the shutdown deadline cuts; notes (path, how its protocol ended it)."""

    async def client(note, http):
        payload = {**body, "model": "fake-model"}
        if body.get("stream"):  # read as it comes: the test client stalls a long stream it buffers
            final = final_of(200, await post_stream(http, path, payload))
        else:
            response = await http.post(path, json=payload)
            final = final_of(response.status_code, await response.get_data())
        note(("cut", path, body.get("stream", False), final))

    return client


def sse_payloads(raw: bytes) -> list[dict]:
    frames = [f for f in raw.decode().split("\n\n") if f.strip()]
    datas = [line.removeprefix("data: ") for f in frames for line in f.split("\n") if line.startswith("data: ")]
    return [json.loads(d) for d in datas if d != "[DONE]"]


def chat_final(status, raw):
    try:
        return status, json.loads(raw)["choices"][0]["finish_reason"]
    except json.JSONDecodeError:
        return status, [c["choices"][0]["finish_reason"] for c in sse_payloads(raw) if c.get("choices")][-1]


def anthropic_final(status, raw):
    try:
        return status, json.loads(raw)["stop_reason"]
    except json.JSONDecodeError:
        return status, [e["delta"]["stop_reason"] for e in sse_payloads(raw) if e["type"] == "message_delta"][-1]


def responses_final(status, raw):
    try:
        final = json.loads(raw)
    except json.JSONDecodeError:
        final = [e["response"] for e in sse_payloads(raw) if "response" in e][-1]  # the last lifecycle event
    return status, final["status"], final["incomplete_details"]


async def test_a_stream_the_shutdown_cuts_says_so_in_each_protocol(autojump_clock):
    """Not "length" (the request's own max_tokens): OpenAI's finish_reason "abort" (vLLM's), the
    nearest each other protocol has: Anthropic's pause_turn, Responses' incomplete."""
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1000}
    anthropic = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1000}
    responses = {"input": "a", "max_output_tokens": 1000}
    clients = [
        cut_client(path, {**body, "stream": stream}, final)
        for path, body, final in (
            ("/v1/chat/completions", chat, chat_final),
            ("/v1/completions", {"prompt": "a", "max_tokens": 1000}, chat_final),
            ("/v1/messages", anthropic, anthropic_final),
            ("/v1/responses", responses, responses_final),
        )
        for stream in (True, False)
    ]
    # Every request has its row and tokens by the signal (a queued one would get 503 instead).
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)

    def all_decoding() -> bool:
        return len(worker.rows) == len(clients) and all(row.generated > 0 for row in worker.rows.values())

    events = await run(worker, clients, timeout=3, signals_at=[5], ready=all_decoding, batch=len(clients))
    cut = {(path, stream): final for _, (name, path, stream, final) in (e for e in events if e[1][0] == "cut")}
    incomplete = (200, "incomplete", {"reason": "max_output_tokens"})
    for stream in (True, False):
        assert cut[("/v1/chat/completions", stream)] == (200, "abort")
        assert cut[("/v1/completions", stream)] == (200, "abort")
        assert cut[("/v1/messages", stream)] == (200, "pause_turn")
        assert cut[("/v1/responses", stream)] == incomplete
