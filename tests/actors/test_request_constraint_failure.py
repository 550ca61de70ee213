"""A row ended by its failed output constraint (TokenOut finish "error") raises GenerationFailed
with a client status, after the events taken before it; its token is never shown."""

from __future__ import annotations

import pytest

from actors.request import GenerationFailed
from model.engine.rows import TokenOut
from tests.helpers.requests import _admitted_actor


async def test_a_failed_constraint_behind_waiting_tokens_comes_after_them():
    actor, rows = await _admitted_actor()
    rows.send_nowait(TokenOut(7, 1))
    rows.send_nowait(TokenOut(7, 2))
    rows.send_nowait(TokenOut(7, 3, finish="error", error="grammar gave up"))
    assert await actor.next_events() == ["<1>", "<2>"]
    with pytest.raises(GenerationFailed, match="grammar gave up") as failed:
        await actor.next_events()
    assert failed.value.status == 400
    assert await actor.next_events() is None
    assert actor.finish_reason is None  # never a normal finish
    actor.close()


async def test_a_failed_constraint_as_the_next_event_raises_at_once():
    actor, rows = await _admitted_actor()
    rows.send_nowait(TokenOut(7, 3, finish="error"))
    with pytest.raises(GenerationFailed) as failed:
        await actor.next_events()
    assert failed.value.status == 400 and str(failed.value)
    actor.close()
