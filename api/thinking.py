"""A row's reasoning as the engine follows it (`ThinkControl`, model/engine/params.py): the
model's markers, the separator its template writes between reasoning and answer, where the row
starts, its budget, and whether its constraint waits for the answer.

A model reasons when its vocabulary holds `<think>` and `</think>` as single tokens (Qwen3,
DeepSeek-R1 style). The separator is read off the template once per tokenizer: an assistant turn
with reasoning rendered, the whitespace between `</think>` and the answer (Qwen3: "\\n\\n"); a
template that renders no reasoning gets "\\n\\n". Every reasoning row gets a control, budget or
not: the engine then also reports which tokens were reasoning (usage `reasoning_tokens`).
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

import attrs

from actors.handles import ServerHandles
from api.pipeline.think import THINK_CLOSE, THINK_OPEN
from model.engine.params import ThinkControl
from model.text.tokenizer import ChatTokenizer

DEFAULT_SEPARATOR = "\n\n"
_PROBE = [
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "ANSWER", "reasoning_content": "REASON"},
]
_AFTER_CLOSE = re.compile(re.escape(THINK_CLOSE) + r"(\s*)ANSWER")


@attrs.frozen
class ThinkMarkers:
    open_id: int
    close_id: int
    separator: tuple[int, ...]


_markers: weakref.WeakKeyDictionary[Any, ThinkMarkers | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def think_markers(tokenizer: ChatTokenizer) -> ThinkMarkers | None:
    """The model's reasoning markers and separator as token ids (None: it has no single-token
    markers), worked out once per tokenizer."""
    with _lock:
        if tokenizer in _markers:
            return _markers[tokenizer]
    markers = _read_markers(tokenizer)
    with _lock:
        _markers[tokenizer] = markers
    return markers


def _read_markers(tokenizer: ChatTokenizer) -> ThinkMarkers | None:
    if not tokenizer.has_thinking:
        return None
    opening = tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    closing = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    if len(opening) != 1 or len(closing) != 1:
        return None
    separator = tokenizer.encode(_separator_text(tokenizer), add_special_tokens=False)
    return ThinkMarkers(opening[0], closing[0], tuple(separator))


def _separator_text(tokenizer: ChatTokenizer) -> str:
    if not tokenizer.has_chat_template:
        return DEFAULT_SEPARATOR
    try:
        text = tokenizer.render_chat(_PROBE, add_generation_prompt=False)
    except Exception:  # a template that refuses the probe: the common separator
        return DEFAULT_SEPARATOR
    found = _AFTER_CLOSE.search(text)
    return found.group(1) if found and "REASON" in text else DEFAULT_SEPARATOR


def think_control(
    tokenizer: ChatTokenizer,
    *,
    starts_in_reasoning: bool,
    thinking: bool | None = None,
    budget: int | None = None,
    constrained: bool = False,
) -> ThinkControl | None:
    """The control of a row of this model (None: it does not reason, or its thinking is off and
    its prompt is not inside a reasoning block). `thinking`: the row's `enable_thinking` (None:
    the template's default). A `constrained` row's constraint waits for the answer when the row
    reasons for sure: its prompt is inside a reasoning block, or thinking was turned on (by the
    request or the server's flags); else it applies from the first token, as without reasoning."""
    markers = think_markers(tokenizer)
    if markers is None or (thinking is False and not starts_in_reasoning):
        return None
    return ThinkControl(
        markers.open_id,
        markers.close_id,
        markers.separator,
        starts_in_reasoning=starts_in_reasoning,
        budget=budget,
        constrain_after=constrained and (starts_in_reasoning or thinking is True),
    )


def row_think_control(
    handles: ServerHandles,
    budget: int | None,
    starts_in_reasoning: bool,
    constrained: bool,
    *,
    thinking: bool | None = None,
) -> ThinkControl | None:
    """`think_control` for a request's rows: its budget, else `--thinking-budget`."""
    return think_control(
        handles.tokenizer,
        starts_in_reasoning=starts_in_reasoning,
        thinking=thinking,
        budget=budget if budget is not None else handles.options.templates.thinking_budget,
        constrained=constrained,
    )
