"""Per-token text pipeline of one completion: tool router → stop matcher → think splitter."""

from api.pipeline.events import Event, TextDelta, ToolCall, ToolCallsEvent
from api.pipeline.sink import CompletionSink
from api.pipeline.think import prompt_ends_in_open_think
from api.pipeline.tools import TOOL_FORMATS, detect_tool_format

__all__ = [
    "TOOL_FORMATS",
    "CompletionSink",
    "Event",
    "TextDelta",
    "ToolCall",
    "ToolCallsEvent",
    "detect_tool_format",
    "prompt_ends_in_open_think",
]
