"""Anthropic `cache_control` → `ChatRequest.cache_points`: where each breakpoint cuts the
conversation, its ttl in seconds, and the 400s for what Anthropic refuses."""

from __future__ import annotations

from typing import Any

import pytest

from api.anthropic.translate import messages_request
from api.errors import ApiError

EPHEMERAL = {"type": "ephemeral"}


def body(**extra: Any) -> dict[str, Any]:
    return {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_a_system_block_breakpoint_cuts_the_system_text_after_its_block():
    request = messages_request(
        body(
            system=[
                {"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL},
                {"type": "text", "text": "Today is Monday."},
            ]
        )
    )
    (point,) = request.cache_points
    assert point.ttl_s == 300.0
    assert point.messages == ({"role": "system", "content": "You are terse."},)
    assert request.prompt.messages[0] == {"role": "system", "content": "You are terse.\nToday is Monday."}


def test_message_blocks_tools_and_a_one_hour_ttl():
    request = messages_request(
        {
            "max_tokens": 8,
            "system": "S",
            "tools": [
                {"name": "a", "input_schema": {"type": "object"}},
                {"name": "b", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ],
            "messages": [
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "reply"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
                        {"type": "text", "text": "two"},
                    ],
                },
            ],
        }
    )
    system = {"role": "system", "content": "S"}
    history = ({"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"})
    assert [(p.ttl_s, p.messages) for p in request.cache_points] == [
        (300.0, (system, *history, {"role": "user", "content": "one"})),
        (3600.0, (system,)),  # a tool definition: the part before the first message
    ]


def test_a_tool_result_breakpoint_ends_after_its_tool_message():
    request = messages_request(
        body(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "42", "cache_control": EPHEMERAL},
                        {"type": "text", "text": "and?"},
                    ],
                },
            ]
        )
    )
    (point,) = request.cache_points
    assert point.messages == request.prompt.messages[:3] and point.messages[-1]["role"] == "tool"


def test_no_cache_control_means_no_points():
    assert messages_request(body()).cache_points == ()


@pytest.mark.parametrize(
    "control",
    [
        {"type": "ephemeral", "ttl": "10m"},
        {"type": "ephemeral", "ttl": 300},
        {"type": "ephemeral", "ttl": ["5m"]},
        {"type": "persistent"},
        "ephemeral",
    ],
)
def test_a_bad_cache_control_is_a_400(control):
    with pytest.raises(ApiError) as caught:
        messages_request(body(system=[{"type": "text", "text": "S", "cache_control": control}]))
    assert caught.value.status == 400 and "cache_control" in caught.value.message


def test_more_than_four_breakpoints_is_a_400():
    blocks = [{"type": "text", "text": str(i), "cache_control": EPHEMERAL} for i in range(5)]
    with pytest.raises(ApiError) as caught:
        messages_request(body(messages=[{"role": "user", "content": blocks}]))
    assert caught.value.status == 400 and "maximum of 4" in caught.value.message
