"""A cheap bound on a prompt's size, checked before the template is rendered or a token encoded.

Tokenizing takes about a microsecond a character and holds the interpreter while it runs, so a
body of megabytes that can never fit the context window is refused by counting characters
first. The bound never refuses a prompt that fits: no token stands for more characters than the
vocabulary's longest piece (at least `CHARS_PER_TOKEN_FLOOR`), with `NORMALIZER_SLACK` for
normalizers that compose several characters into one. Only message text is counted (the
template adds, never removes, other text), and an assistant turn's reasoning before its last
`</think>` is not, since templates drop earlier turns' reasoning.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from api.errors import ApiError, bad_request

CHARS_PER_TOKEN_FLOOR = 16
NORMALIZER_SLACK = 3
THINK_END = "</think>"

_longest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def message_chars(messages: Iterable[dict[str, Any]]) -> int:
    """The characters of the messages' text contents that every template renders."""
    total = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            continue
        if message.get("role") == "assistant" and THINK_END in content:
            content = content.rsplit(THINK_END, 1)[-1]
        total += len(content)
    return total


def chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for (bounded below by the floor)."""
    try:
        with _lock:
            cached = _longest.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
        cached = None
    if cached is None:
        cached = max(CHARS_PER_TOKEN_FLOOR, _longest_piece(tokenizer))
        try:
            with _lock:
                _longest[tokenizer] = cached
        except TypeError:
            pass
    return cached * NORMALIZER_SLACK


def _longest_piece(tokenizer: Any) -> int:
    size, piece = tokenizer.vocab_size, tokenizer.id_to_token
    if size is None:
        return 0
    longest = 0
    for token_id in range(size):
        try:
            longest = max(longest, len(piece(token_id)))
        except Exception:  # a hole in the id space
            continue
    return longest


def check_chars(chars: int, *, tokenizer: Any, context_length: int, param: str = "messages") -> None:
    """400 when `chars` characters of text cannot fit `context_length` tokens."""
    if context_length <= 0 or chars <= context_length * CHARS_PER_TOKEN_FLOOR:
        return  # fits even at the floor: the vocabulary need not be read
    if chars > context_length * chars_per_token(tokenizer):
        raise too_long(f"{chars} characters of text", context_length, param)


def check_tokens(tokens: int, *, context_length: int, param: str = "prompt") -> None:
    """400 when a prompt of `tokens` leaves no room in the context window to generate one token
    (Anthropic's wording, which clients match to trim their history). A prompt that fits the
    window but not the memory budget is admission's 400 (`context_over_budget`)."""
    if context_length > 0 and tokens >= context_length:
        raise bad_request(
            f"prompt is too long: {tokens} tokens > {context_length - 1} maximum (this model's context "
            f"window is {context_length} tokens, one of them for the first generated token)",
            param=param,
            code="context_length_exceeded",
        )


def text_tokens(prompt: str | Sequence[int], *, tokenizer: Any, context_length: int) -> list[int]:
    """A raw prompt's token ids (a text encoded, ids as given), once it fits the context window:
    the characters bounded before the text is encoded. Raises ApiError (400)."""
    if isinstance(prompt, str):
        check_chars(len(prompt), tokenizer=tokenizer, context_length=context_length, param="prompt")
        tokens = tokenizer.encode(prompt)
    else:
        tokens = list(prompt)
    check_tokens(len(tokens), context_length=context_length)
    return tokens


def too_long(what: str, context_length: int, param: str) -> ApiError:
    return bad_request(
        f"the prompt is too long: {what} cannot fit this model's context window of {context_length} tokens",
        param=param,
        code="context_length_exceeded",
    )
