"""Tool-call routers, one module per format, and the choice between them."""

from __future__ import annotations

from collections.abc import Callable

from api.pipeline.tools.base import PlainRouter, ToolRouter
from api.pipeline.tools.hermes import hermes_router
from api.pipeline.tools.llama3_json import Llama3JsonRouter
from api.pipeline.tools.mistral import mistral_router
from api.pipeline.tools.qwen3_coder import qwen3_coder_router

_ROUTERS: dict[str, Callable[[], ToolRouter]] = {
    "hermes": hermes_router,
    "qwen3_coder": qwen3_coder_router,
    "llama3_json": Llama3JsonRouter,
    "mistral": mistral_router,
}

TOOL_FORMATS = tuple(_ROUTERS)


def make_tool_router(tool_format: str | None, *, tools_present: bool) -> ToolRouter:
    """Without tools in the request nothing is parsed: markup the model emits anyway is content."""
    if not tools_present or tool_format is None:
        return PlainRouter()
    try:
        return _ROUTERS[tool_format]()
    except KeyError:
        raise ValueError(f"unknown tool format {tool_format!r}; known: {TOOL_FORMATS}") from None
