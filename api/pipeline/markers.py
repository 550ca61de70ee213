"""Shared text-scanning primitive for the streaming stages (stop, think, tools)."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker.

    Streaming stages hold back exactly this many trailing characters: they might be the start
    of a marker that the next token completes, so emitting them could leak marker text.
    """
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
