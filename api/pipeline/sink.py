"""The per-token text pipeline of one completion: tool router → stop matcher → think splitter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallDelta, ToolCallsEvent, ToolCallStart, new_call_id
from api.pipeline.stop import StopMatcher
from api.pipeline.think import PassthroughSplitter, ThinkSplitter
from api.pipeline.tools import make_tool_router
from api.pipeline.tools.base import CallArgs, CallStart, RoutedItem

FINISH_CAUSES = ("stop", "length", "eos")  # why generation ended: a stop string, the length cap, EOS


class StreamingDetokenizer(Protocol):
    def add_token(self, token_id: int) -> None: ...

    @property
    def last_segment(self) -> str: ...

    def finalize(self) -> None: ...


class CompletionSink:
    """Turns generated token ids into content / reasoning deltas and tool calls.

    A call streams: its header (ToolCallStart) once the router knows its name, then its arguments
    (ToolCallDelta) as they are parsed; at the end ToolCallsEvent lists every call, each with the
    concatenation of its deltas as arguments, so a stream and a whole answer agree exactly. A
    header cannot be taken back: a call whose arguments the generation cut (max_tokens) or whose
    markup broke after its header stays a call, with the arguments that were streamed (not valid
    JSON then), and a cut at max_tokens makes the finish reason "length", not "tool_calls"
    (vLLM streams such calls the same way). Markup that fails before any header is content.

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
        parallel_tool_calls: bool = True,
    ) -> None:
        self._detokenizer = detokenizer
        # Another choice of the same request (`n`) gets a sink configured as this one.
        self._options = (tuple(stop), think, starts_in_reasoning, tool_format, tools_present, parallel_tool_calls)
        self._single_call = not parallel_tool_calls  # the first finished call stops generation
        self._router = make_tool_router(tool_format, tools_present=tools_present)
        self._stop = StopMatcher(stop)
        self._splitter = (
            ThinkSplitter(starts_in_reasoning=starts_in_reasoning)
            if think or starts_in_reasoning
            else PassthroughSplitter()
        )
        self._finished = False
        self.stopped = False
        self.tool_calls: list[ToolCall] = []  # the finished ones
        self._open_call: ToolCallStart | None = None  # the call being streamed
        self._open_arguments: list[str] = []  # its arguments so far
        self._cut_at_end = False  # the generation ended inside a call's arguments
        # The text so far, as pieces: `+=` on an attribute copies the whole string every token.
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "tool_calls" once finished

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def fresh(self, detokenizer: StreamingDetokenizer) -> CompletionSink:
        """A new sink configured as this one was, reading `detokenizer` (another choice)."""
        stop, think, starts_in_reasoning, tool_format, tools_present, parallel = self._options
        return CompletionSink(
            detokenizer,
            stop=stop,
            think=think,
            starts_in_reasoning=starts_in_reasoning,
            tool_format=tool_format,
            tools_present=tools_present,
            parallel_tool_calls=parallel,
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
        deltas: list[Event] = []
        if not self.stopped:
            self._detokenizer.finalize()
            deltas += self._route(self._router.feed(self._detokenizer.last_segment))
        if not self.stopped:
            deltas += self._route(self._router.finish(), at_end=True)
        if not self.stopped:
            deltas += self._splitter.feed(self._stop.flush())
            deltas += self._splitter.flush()
        events: list[Event] = list(self._record(deltas))
        if self.tool_calls:
            events.append(ToolCallsEvent(tuple(self.tool_calls)))
            self.finish_reason = "length" if reason == "length" and self._cut_at_end else "tool_calls"
        else:
            self.finish_reason = "length" if reason == "length" else "stop"
        return events

    def _route(self, items: list[RoutedItem], *, at_end: bool = False) -> list[Event]:
        events: list[Event] = []
        for item in items:
            if self.stopped:
                break  # calls and prose after a stop match are never reported
            if isinstance(item, str):
                events += self._splitter.feed(self._stop.feed(item))
                if self._stop.matched is not None:
                    self.stopped = True
                    events += self._splitter.flush()
            elif isinstance(item, CallStart):
                # Withheld markup sat between the held tails and the next prose, so those tails
                # can no longer grow into a stop string or a think tag.
                events += self._splitter.feed(self._stop.flush())
                events += self._splitter.flush()
                self._open_call = ToolCallStart(len(self.tool_calls), new_call_id(), item.name)
                events.append(self._open_call)
            elif self._open_call is None:
                raise RuntimeError(f"{item!r} outside a tool call")
            elif isinstance(item, CallArgs):
                self._open_arguments.append(item.text)
                events.append(ToolCallDelta(self._open_call.index, item.text))
            else:
                call, self._open_call = self._open_call, None
                self.tool_calls.append(ToolCall(call.id, call.name, "".join(self._open_arguments)))
                self._open_arguments = []
                self._cut_at_end = at_end and item.cut
                # `parallel_tool_calls: false` (vLLM keeps the first call too): nothing after it
                # is reported, and the caller ends the generation (as after a stop string).
                self.stopped = self.stopped or self._single_call
        return events

    def _record(self, events: list[Event]) -> list[Event]:
        """Keep the totals; merge adjacent pieces of the same kind (of text, or of one call)."""
        merged: list[Event] = []
        for event in events:
            last = merged[-1] if merged else None
            if isinstance(event, TextDelta):
                if not event.text:
                    continue
                (self._content if event.kind == "content" else self._reasoning).append(event.text)
                if isinstance(last, TextDelta) and last.kind == event.kind:
                    event = TextDelta(event.kind, last.text + event.text)
                    merged.pop()
            elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
                event = ToolCallDelta(event.index, last.arguments + event.arguments)
                merged.pop()
            merged.append(event)
        return merged
