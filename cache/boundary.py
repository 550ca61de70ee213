"""Where a chat prompt stops being stable across turns (the boundary-snapshot position).

The next turn of a conversation re-renders this turn's prompt followed by the assistant's reply
and a new message. Its tokens agree with this turn's prompt up to some point short of the end:
templates often write a generation-prompt tail (e.g. Qwen3's empty think block) that a reply in
history does not keep, and the reply's re-encoding rarely matches the generated ids. Snapshotting
the KV at that point lets the next turn hit even when the prompt+generation entry cannot be used.

We find it by rendering the conversation as the next turn would (a dummy assistant reply, then a
dummy user message, no generation prompt) and taking the common token prefix with the real
prompt. How many tail tokens fall outside ("the primer") depends only on the template mode, so it
is memoized per mode and later calls cost nothing beyond the prompt encoding the caller already
has. A wrong boundary can only cost a cache miss: cache keys are exact token tuples.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cache.prefix_match import common_prefix_length
from model.text.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

MAX_PRIMER = 64  # a longer "tail" means the probe went wrong, not a template constant
_DUMMY_TURN = ({"role": "assistant", "content": "OK"}, {"role": "user", "content": "OK"})

_primers: weakref.WeakKeyDictionary[ChatTokenizer, dict[tuple, int]] = weakref.WeakKeyDictionary()


def _mode(tools: Sequence[Any] | None, template_kwargs: Mapping[str, Any]) -> tuple:
    return (bool(tools), tuple(sorted((k, repr(v)) for k, v in template_kwargs.items())))


def stable_prefix_length(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prompt_tokens: Sequence[int] | None = None,
    **template_kwargs: Any,
) -> int:
    """Tokens of the generation-prompt encoding of `messages` that the next turn will share.
    Pass `prompt_tokens` when the caller has already encoded the prompt. 0 = no usable boundary."""
    if prompt_tokens is None:
        prompt_tokens = tokenizer.encode_chat(messages, tools=tools, **template_kwargs)
    n = len(prompt_tokens)
    memo = _primers.setdefault(tokenizer, {})
    mode = _mode(tools, template_kwargs)
    primer = memo.get(mode)
    if primer is None:
        try:
            closed = tokenizer.encode_chat(
                [*messages, *_DUMMY_TURN], tools=tools, add_generation_prompt=False, **template_kwargs
            )
        except Exception:
            # Templates may reject the probe (e.g. strict role alternation): no snapshot, no harm.
            log.debug("stable prefix probe failed to render", exc_info=True)
            return 0
        common = common_prefix_length(np.asarray(prompt_tokens, np.int64), np.asarray(closed, np.int64))
        primer = n - common
        if primer > MAX_PRIMER:
            return common  # right for this conversation, but not trusted as the mode's constant
        memo[mode] = primer
    return max(0, n - primer)
