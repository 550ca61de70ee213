"""What every protocol's message translation shares: chat-template conventions and the 400s for
content the server cannot take.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from api.errors import ApiError, bad_request

# Content part types that carry media, and the kind of input each would need.
MEDIA_PARTS = {
    "image_url": "image",
    "image": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "video": "video",
    "file": "file",
    "input_file": "file",
}


def media_error(kind: str) -> ApiError:
    """The 400 for a media content part of type `kind` (a key of MEDIA_PARTS): text-only model."""
    return bad_request(
        f"{kind} content parts are not supported: this server has no {MEDIA_PARTS[kind]} input (text-only model)",
        param="messages",
        code="unsupported_content_type",
    )


def tool_call_id_error(where: str) -> ApiError:
    """The 400 for a tool-result message (`where`, e.g. "messages[3]") whose call id is not a string."""
    return bad_request(f"{where}.tool_call_id must be a string", param="messages")


def template_arguments(arguments: Any) -> Any:
    """A history tool call's arguments as templates read them: a JSON string parsed to its value
    (an empty one is `{}`); anything that is not JSON is rendered as it came."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return arguments


def late_system_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The texts of system messages after the first message (mid-conversation system turns)."""
    return [
        m["content"]
        for m in messages[1:]
        if m.get("role") == "system" and isinstance(m.get("content"), str) and m["content"]
    ]


def join_late_system(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every system message after the first joined (a blank line apart, in order)
    to the leading system message, which is created when there is none: for templates that
    render a system prompt only at the start (they raise on, or silently drop, a later one)."""
    late = late_system_texts(messages)
    rest = [dict(m) for i, m in enumerate(messages) if i == 0 or m.get("role") != "system"]
    if rest and rest[0].get("role") == "system" and isinstance(rest[0].get("content"), str):
        head = rest[0]["content"]
        rest[0]["content"] = "\n\n".join([head, *late]) if head else "\n\n".join(late)
        return rest
    return [{"role": "system", "content": "\n\n".join(late)}, *rest]
