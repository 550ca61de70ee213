"""HTTP against the app in-process (quart-trio's test client)."""

from __future__ import annotations

import json
from typing import Any

import trio


async def post_stream(client: Any, path: str, payload: dict) -> bytes:
    """A streamed response's whole body. (`client.post` buffers only 10 body chunks before the
    app blocks on the 11th and the test client deadlocks, so long streams are read as they come.)"""
    async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
        await conn.send(json.dumps(payload).encode())
        await conn.send_complete()
        assert conn.status_code in (None, 200)
        data = b""
        while True:
            try:
                data += await conn.receive()
            except trio.EndOfChannel:
                return data
