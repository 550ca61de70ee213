"""What every tool router hands the rest of the pipeline."""

from __future__ import annotations

from typing import Protocol

from api.pipeline.events import ToolCall

# Prose and parsed calls in stream order, so the sink can drop calls that come after a stop match.
RoutedItem = str | ToolCall


class ToolRouter(Protocol):
    def feed(self, text: str) -> list[RoutedItem]:
        """Consume decoded text; return prose that is safe to pass on and any completed calls."""
        ...

    def finish(self) -> list[RoutedItem]:
        """End of generation: parse withheld markup, or release it as prose if it does not parse."""
        ...


class PlainRouter:
    """No tools in the request: every character is prose."""

    def feed(self, text: str) -> list[RoutedItem]:
        return [text] if text else []

    def finish(self) -> list[RoutedItem]:
        return []
