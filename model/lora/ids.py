"""What may name a LoRA adapter (no MLX here: the flags and the API check ids before any load)."""

from __future__ import annotations

import re

# An id names the adapter in "a+b" stacks, "<model>:<id>" names and /v1/adapters/<id> paths, and
# --adapters-dir's <id> subdirectory: no "+", ":", "/" or leading "." ("..", hidden entries).
_ADAPTER_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
NO_ADAPTER = "none"  # a request's "adapter": "none" is the base model: never an id


def adapter_id_problem(adapter_id: str) -> str | None:
    """Why `adapter_id` cannot name an adapter, or None when it can."""
    if adapter_id == NO_ADAPTER:
        return f"adapter id {adapter_id!r} is reserved (it selects the base model)"
    if not _ADAPTER_ID.fullmatch(adapter_id):
        return f"adapter id {adapter_id!r}: use letters, digits, '-', '_' or '.' (not first), at most 128"
    return None
