"""Request bodies parsed as strict JSON, so hostile bytes are a 400, never a 500.

Quart's `get_json` decodes the body outside its own `try` (invalid UTF-8 → `UnicodeDecodeError`
→ 500) and lets `RecursionError` from a deeply nested body escape (→ 500). Python's `json` also
accepts `NaN` / `Infinity`, which are not JSON (RFC 8259), turns `1e400` into infinity, and
accepts `\\ud800`-style lone surrogates, which are not text: they break the tokenizer, the log
handler and every encoder downstream.

`StrictJsonRequest.get_json` turns all of these into a parse failure, so every route's
`get_json(force=True, silent=True)` sees `None` and answers its own "invalid JSON body" 400 in
its own API shape. Installed as the app's `request_class` by `api.http.security.install_security`.

A body over `INLINE_BYTES` is parsed on a worker thread (api/http/offload.py): parsing megabytes
takes tens of milliseconds the event loop's other streams should not wait out, while 64 KiB
parses in about 0.1 ms, less than the thread hop. The body's size is noted for the work that
follows (`offload.run`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from quart_trio.wrappers.request import TrioRequest

from api.http import offload

INLINE_BYTES = 64 << 10
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class InvalidJson(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):  # 1e400: valid JSON grammar, but no number a field can take
        raise InvalidJson(f"number {text[:32]} is out of range")
    return value


def loads_strict(raw: bytes) -> Any:
    """`json.loads` for a request body; raises `ValueError` for anything that is not strict
    UTF-8 JSON text (deep nesting included)."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise InvalidJson("JSON nested too deeply") from exc
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise InvalidJson("JSON string holds a lone UTF-16 surrogate")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class StrictJsonRequest(TrioRequest):
    async def get_json(self, force: bool = False, silent: bool = False, cache: bool = True) -> Any:
        if cache and self._cached_json[silent] is not Ellipsis:
            return self._cached_json[silent]
        if not (force or self.is_json):
            return None
        raw = await self.get_data(cache=cache, as_text=False)
        try:
            data = raw.encode() if isinstance(raw, str) else raw  # as_text=False: bytes
            offload.note_body(len(data))
            result = loads_strict(data) if len(data) <= INLINE_BYTES else await offload.to_thread(loads_strict, data)
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            result = None if silent else self.on_json_loading_failed(error)
        if cache:
            self._cached_json[silent] = result
        return result
