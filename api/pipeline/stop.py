"""Stop-string matching on decoded text, across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from api.pipeline.markers import partial_marker_length


class StopMatcher:
    """Passes text through until a stop string appears; nothing from the match on is released.

    A tail that could still grow into a stop string is held back, so a client never sees any
    part of one. The winner is the stop string that *completes* first (ties: the one starting
    earliest): that is what token-by-token streaming observes, so the result does not depend on
    how the text was split into tokens.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stop if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the text that is now safe to emit."""
        if self.matched is not None or not self._stops:
            return "" if self.matched is not None else text
        buffer = self._held + text
        match = self._first_completed(buffer)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return buffer[:start]
        keep = partial_marker_length(buffer, self._stops)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held tail at the end of generation (only ever non-empty without a match)."""
        held, self._held = self._held, ""
        return held

    def _first_completed(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])
