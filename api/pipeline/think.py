"""Splits `<think>` … `</think>` blocks out of the text stream as reasoning."""

from __future__ import annotations

from api.pipeline.events import TextDelta, TextKind
from api.pipeline.markers import partial_marker_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_ends_in_open_think(prompt_text: str) -> bool:
    """True when the rendered prompt ends in an open `<think>` (Qwen3 / DeepSeek-R1 templates
    pre-fill `<think>\\n`), so generation starts inside reasoning.

    Only the very end counts (trailing whitespace aside): a `<think>` quoted inside a message
    leaves the block "open" by a tag count, yet the reply starts outside reasoning.
    """
    return prompt_text.rstrip().endswith(THINK_OPEN)


class ThinkSplitter:
    """Routes text outside think tags to content and text inside to reasoning; tags are dropped.

    Text right after `</think>` is passed through untouched (including the "\\n\\n" Qwen3 puts
    there): mlx-lm's TextStateMachine strips only the tag itself, and we keep parity with it.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._kind: TextKind = "reasoning" if starts_in_reasoning else "content"
        self._held = ""

    @property
    def kind(self) -> TextKind:
        return self._kind

    def feed(self, text: str) -> list[TextDelta]:
        buffer = self._held + text
        deltas: list[TextDelta] = []
        while True:
            tag = THINK_CLOSE if self._kind == "reasoning" else THINK_OPEN
            at = buffer.find(tag)
            if at < 0:
                break
            _append(deltas, self._kind, buffer[:at])
            buffer = buffer[at + len(tag) :]
            self._kind = "content" if self._kind == "reasoning" else "reasoning"
        keep = partial_marker_length(buffer, (tag,))
        self._held = buffer[len(buffer) - keep :]
        _append(deltas, self._kind, buffer[: len(buffer) - keep])
        return deltas

    def flush(self) -> list[TextDelta]:
        """Release a held partial tag as plain text of the current kind."""
        held, self._held = self._held, ""
        deltas: list[TextDelta] = []
        _append(deltas, self._kind, held)
        return deltas


class PassthroughSplitter:
    """Used when the model has no think tags: everything is content."""

    kind: TextKind = "content"

    def feed(self, text: str) -> list[TextDelta]:
        return [TextDelta("content", text)] if text else []

    def flush(self) -> list[TextDelta]:
        return []


def _append(deltas: list[TextDelta], kind: TextKind, text: str) -> None:
    if not text:
        return
    if deltas and deltas[-1].kind == kind:
        deltas[-1] = TextDelta(kind, deltas[-1].text + text)
    else:
        deltas.append(TextDelta(kind, text))
