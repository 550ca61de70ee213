"""OpenAI's prompt-cache hints, read the same way on /v1/chat/completions and /v1/responses.

* `prompt_cache_retention`: `"in_memory"` (the default; `"in-memory"` is taken too) asks
  nothing; `"24h"` keeps the prompt's prefixes for 24 hours as an Anthropic `cache_control`
  breakpoint with a 1 h ttl keeps its own for an hour (`CachePoint`s the chat core maps to prompt
  positions: the system part, where templates render the tools, and the whole conversation
  before the generation prompt, which the next turn starts with). The RAM tier protects them
  from LRU eviction within `--cache-retention-share`; the SSD tier writes them with their
  deadline and evicts them after every unhinted entry (cache/ssd_index.py).
* `prompt_cache_key`: on one server every request already meets the one cache, so the key only
  names the group (echoed, logged). With `--prompt-cache-key-isolation` it becomes part of the
  cache namespace: requests with different keys (or none) never share an entry, RAM or SSD.

Anything else is a 400 naming the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import attrs

from api.chat_request import CachePoint
from api.errors import bad_request

RETENTION_24H_S = 24 * 3600.0
RETENTIONS = {"in_memory": None, "in-memory": None, "24h": RETENTION_24H_S}
MAX_KEY_CHARS = 1024  # a key is an identifier (Codex sends a UUID); a larger one is a mistake


@attrs.frozen
class CacheHints:
    key: str | None = None
    retention: str | None = None  # as OpenAI spells it back: "in_memory" | "24h" | None (not asked)

    @property
    def retain_s(self) -> float | None:
        return RETENTIONS.get(self.retention or "")


def cache_hints(body: Mapping[str, Any]) -> CacheHints:
    """The request's hints, checked (400 naming the field)."""
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > MAX_KEY_CHARS):
        raise bad_request(
            f"prompt_cache_key must be a string of at most {MAX_KEY_CHARS} characters", param="prompt_cache_key"
        )
    retention = body.get("prompt_cache_retention")
    if retention is not None and (not isinstance(retention, str) or retention not in RETENTIONS):
        raise bad_request("prompt_cache_retention must be 'in_memory' or '24h'", param="prompt_cache_retention")
    return CacheHints(key=key, retention=None if retention is None else retention.replace("-", "_"))


def retention_points(messages: tuple[dict[str, Any], ...], hints: CacheHints) -> tuple[CachePoint, ...]:
    """The breakpoints a `24h` retention asks for: the leading system messages (with the tools the
    template renders there) and the whole conversation; none otherwise."""
    ttl_s = hints.retain_s
    if ttl_s is None or not messages:
        return ()
    system = tuple(m for m in _leading(messages) if m.get("role") == "system")
    points = [CachePoint(ttl_s, system)] if system and len(system) < len(messages) else []
    return (*points, CachePoint(ttl_s, tuple(messages)))


def _leading(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("role") != "system":
            break
        out.append(message)
    return out


def key_namespace(key: str | None) -> str:
    """The cache namespace of a key under --prompt-cache-key-isolation ("" for no key: the shared one)."""
    return "" if key is None else "pck-" + hashlib.sha256(key.encode()).hexdigest()[:16]
