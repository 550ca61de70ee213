"""The per-token text pipeline of one completion: tool router → stop matcher → think splitter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallsEvent
from api.pipeline.stop import StopMatcher
from api.pipeline.think import PassthroughSplitter, ThinkSplitter
from api.pipeline.tools import make_tool_router
from api.pipeline.tools.base import RoutedItem

FINISH_CAUSES = ("stop", "length", "eos")  # why generation ended: a stop string, the length cap, EOS


class StreamingDetokenizer(Protocol):
    def add_token(self, token_id: int) -> None: ...

    @property
    def last_segment(self) -> str: ...

    def finalize(self) -> None: ...


class CompletionSink:
    """Turns generated token ids into content / reasoning deltas and, at the end, tool calls.

    The caller pushes every generated token except EOS ids (their text would show, as special
    tokens are not skipped), ends the generation as soon as `stopped` turns true, and then calls
    `finish` exactly once. The tool router runs first, so a tool call may start inside reasoning
    (as in mlx-lm's TextStateMachine); unlike mlx-lm, the splitter then stays in reasoning until
    `</think>` rather than jumping to content.
    """

    def __init__(
        self,
        detokenizer: StreamingDetokenizer,
        *,
        stop: Sequence[str] = (),
        think: bool = False,
        starts_in_reasoning: bool = False,
        tool_format: str | None = None,
        tools_present: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        # Another choice of the same request (`n`) gets a sink configured as this one.
        self._options = (tuple(stop), think, starts_in_reasoning, tool_format, tools_present)
        self._router = make_tool_router(tool_format, tools_present=tools_present)
        self._stop = StopMatcher(stop)
        self._splitter = (
            ThinkSplitter(starts_in_reasoning=starts_in_reasoning)
            if think or starts_in_reasoning
            else PassthroughSplitter()
        )
        self._finished = False
        self.stopped = False
        self.tool_calls: list[ToolCall] = []
        self.content = ""
        self.reasoning = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "tool_calls" once finished

    def fresh(self, detokenizer: StreamingDetokenizer) -> CompletionSink:
        """A new sink configured as this one was, reading `detokenizer` (another choice)."""
        stop, think, starts_in_reasoning, tool_format, tools_present = self._options
        return CompletionSink(
            detokenizer,
            stop=stop,
            think=think,
            starts_in_reasoning=starts_in_reasoning,
            tool_format=tool_format,
            tools_present=tools_present,
        )

    @property
    def matched_stop(self) -> str | None:
        return self._stop.matched

    def push(self, token_id: int) -> list[Event]:
        if self.stopped or self._finished:
            return []
        self._detokenizer.add_token(token_id)
        return list(self._record(self._route(self._router.feed(self._detokenizer.last_segment))))

    def finish(self, *, reason: str) -> list[Event]:
        """End of generation. Held-back text is released unless a stop string matched, in which
        case it (and whatever the detokenizer still buffers) lies after the match and is dropped."""
        if reason not in FINISH_CAUSES:
            raise ValueError(f"unknown finish reason {reason!r}")
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        deltas: list[TextDelta] = []
        if not self.stopped:
            self._detokenizer.finalize()
            deltas += self._route(self._router.feed(self._detokenizer.last_segment))
        if not self.stopped:
            deltas += self._route(self._router.finish())
        if not self.stopped:
            deltas += self._splitter.feed(self._stop.flush())
            deltas += self._splitter.flush()
        events: list[Event] = list(self._record(deltas))
        if self.tool_calls:
            events.append(ToolCallsEvent(tuple(self.tool_calls)))
            self.finish_reason = "tool_calls"
        else:
            self.finish_reason = "length" if reason == "length" else "stop"
        return events

    def _route(self, items: list[RoutedItem]) -> list[TextDelta]:
        deltas: list[TextDelta] = []
        for item in items:
            if self.stopped:
                break  # calls and prose after a stop match are never reported
            if isinstance(item, ToolCall):
                self.tool_calls.append(item)
                # Withheld markup sat between the held tails and the next prose, so those tails
                # can no longer grow into a stop string or a think tag.
                deltas += self._splitter.feed(self._stop.flush())
                deltas += self._splitter.flush()
                continue
            deltas += self._splitter.feed(self._stop.feed(item))
            if self._stop.matched is not None:
                self.stopped = True
                deltas += self._splitter.flush()
        return deltas

    def _record(self, deltas: list[TextDelta]) -> list[TextDelta]:
        merged: list[TextDelta] = []
        for delta in deltas:
            if not delta.text:
                continue
            if delta.kind == "content":
                self.content += delta.text
            else:
                self.reasoning += delta.text
            if merged and merged[-1].kind == delta.kind:
                merged[-1] = TextDelta(delta.kind, merged[-1].text + delta.text)
            else:
                merged.append(delta)
        return merged
