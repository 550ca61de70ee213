"""A request actor admitted against fake ports."""

from __future__ import annotations

import contextlib
import math
from typing import Any, cast

import trio

from actors.messages import Admitted, GenerationRequest, Submit
from actors.request import RequestActor, RequestPorts
from model.engine.params import SamplingParams
from model.engine.rows import RowOpened


class _Admission:
    cutoff = math.inf

    def __init__(self) -> None:
        self.in_flight = 0

    @contextlib.contextmanager
    def queued_scope(self):
        with trio.CancelScope() as scope:
            yield scope

    @contextlib.contextmanager
    def cutoff_scope(self):
        with trio.CancelScope(deadline=self.cutoff) as scope:
            yield scope

    def request_started(self) -> None:
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1


class _Sink:
    """Token t → the text event "<t>"."""

    stopped = False
    finish_reason = None

    def push(self, token_id: int) -> list[str]:
        return [f"<{token_id}>"]

    def finish(self, *, reason: str) -> list[str]:
        return [f"end:{reason}"]


async def _admitted_actor(max_tokens: int = 1000) -> tuple[RequestActor, trio.MemorySendChannel]:
    submits_send, submits_recv = trio.open_memory_channel[Submit](1)
    control_send, _control_recv = trio.open_memory_channel(math.inf)
    # (the doubles stand in for admission's counters and a sink: they implement what the actor uses)
    ports = RequestPorts(submits=submits_send, control=control_send, admission=cast(Any, _Admission()))
    request = GenerationRequest(prompt=(1, 2, 3), sampling=SamplingParams(), max_tokens=max_tokens)
    actor: RequestActor[str] = RequestActor(ports, request, cast(Any, _Sink()))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.admit)
        submit = await submits_recv.receive()
        submit.reply.send_nowait(Admitted(row_id=7, max_tokens=max_tokens, lane="batched", seed=0))
        submit.rows.send_nowait(RowOpened(7, cached_tokens=2, to_prefill=0))  # admit returns once the row opens
    return actor, submit.rows
