"""What every protocol's message translation shares: chat-template conventions and the 400s for
content the server cannot take.
"""

from __future__ import annotations

import json
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
