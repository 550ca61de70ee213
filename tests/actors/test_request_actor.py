"""The request actor on its own: what `next_events` takes in one call, and in what order; what it
tells its observer."""

from __future__ import annotations

import math

import pytest
import trio

from actors.messages import NULL_OBSERVER, Abort, Admitted, GenerationRequest, RowFailed, Submit
from actors.request import MAX_TOKENS_PER_TURN, GenerationFailed, RequestActor, RequestPorts, observing
from model.engine.params import SamplingParams
from model.engine.rows import RowOpened, TokenOut
from tests.helpers.requests import _Admission, _admitted_actor, _Sink


async def test_waiting_tokens_are_taken_in_one_call_in_order():
    actor, rows = await _admitted_actor()
    for t in range(5):
        rows.send_nowait(TokenOut(7, 100 + t))
    assert await actor.next_events() == [f"<{100 + t}>" for t in range(5)]
    assert actor.cached_tokens == 2 and actor.completion_tokens == 5
    # nothing waiting now: the next call blocks until a token arrives
    with trio.move_on_after(0.01) as scope:
        await actor.next_events()
    assert scope.cancelled_caught
    rows.send_nowait(TokenOut(7, 9, finish="length"))
    assert await actor.next_events() == ["<9>", "end:length"]
    assert await actor.next_events() is None
    actor.close()


async def test_one_call_takes_at_most_a_turn_of_tokens():
    actor, rows = await _admitted_actor()
    for t in range(MAX_TOKENS_PER_TURN + 3):
        rows.send_nowait(TokenOut(7, t))
    assert len(await actor.next_events()) == MAX_TOKENS_PER_TURN
    assert await actor.next_events() == [f"<{t}>" for t in range(MAX_TOKENS_PER_TURN, MAX_TOKENS_PER_TURN + 3)]
    actor.close()


async def test_a_failure_behind_waiting_tokens_comes_after_them():
    actor, rows = await _admitted_actor()
    rows.send_nowait(TokenOut(7, 1))
    rows.send_nowait(TokenOut(7, 2))
    rows.send_nowait(RowFailed(7, "boom"))
    rows.send_nowait(TokenOut(7, 3))  # never shown: the row failed before it
    assert await actor.next_events() == ["<1>", "<2>"]
    with pytest.raises(GenerationFailed, match="boom"):
        await actor.next_events()
    assert await actor.next_events() is None
    actor.close()


async def test_the_row_ending_without_a_finish_ends_the_taken_events():
    actor, rows = await _admitted_actor()
    rows.send_nowait(TokenOut(7, 1))
    rows.close()  # the scheduler ended the row (shutdown)
    assert await actor.next_events() == ["<1>", "end:length"]
    assert await actor.next_events() is None
    actor.close()


class _Observer:
    """A `RequestObserver` that lists what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.events.append((name, *args))


async def _observed_actor(observer) -> tuple[RequestActor, trio.MemorySendChannel, Submit, trio.MemoryReceiveChannel]:
    token = observing.set(observer)
    try:
        submits_send, submits_recv = trio.open_memory_channel[Submit](1)
        control_send, control_recv = trio.open_memory_channel(math.inf)
        ports = RequestPorts(submits=submits_send, control=control_send, admission=_Admission())
        actor = RequestActor(
            ports, GenerationRequest(prompt=(1, 2, 3), sampling=SamplingParams(), max_tokens=9), _Sink()
        )
    finally:
        observing.reset(token)  # the actor keeps the observer it was built with
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.admit)
        submit = await submits_recv.receive()
        submit.reply.send_nowait(Admitted(row_id=7, max_tokens=9, lane="batched", seed=0))
        submit.rows.send_nowait(RowOpened(7, cached_tokens=0, to_prefill=2))  # admit returns once the row opens
    return actor, submit.rows, submit, control_recv


async def test_the_observer_of_the_context_hears_the_submit_and_the_finish():
    observer = _Observer()
    actor, rows, submit, _ = await _observed_actor(observer)
    assert submit.observer is observer and observer.events == [("submitted", (1, 2, 3))]
    rows.send_nowait(TokenOut(7, 1))
    rows.send_nowait(TokenOut(7, 2, finish="stop"))  # EOS: the client is told "stop"
    await actor.next_events()
    actor.close()
    assert observer.events == [("submitted", (1, 2, 3)), ("finished", "stop")]  # no abort: the row ended


async def test_the_observer_hears_an_abort_when_the_row_is_cut():
    observer = _Observer()
    actor, rows, _, control = await _observed_actor(observer)
    rows.send_nowait(TokenOut(7, 1))
    await actor.next_events()
    actor.close()  # the client left mid-stream
    assert observer.events[-1] == ("aborted",) and control.receive_nowait() == Abort(7)


async def test_outside_any_observed_context_the_actor_tells_the_null_observer():
    actor, _ = await _admitted_actor()
    assert actor._observer is NULL_OBSERVER
    actor.close()
