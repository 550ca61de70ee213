"""A thinking chat template for the tiny synthetic models (their tokenizers hold `<think>` and
`</think>` as single tokens): the generation prompt opens the reasoning block, as Qwen3's does,
unless `enable_thinking` is false; an assistant turn's reasoning renders before its answer, so
the server reads the separator ("\\n\\n") off it. Served with `--chat-template`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.realserver import JSON, sse_payloads

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def write_thinking_template(directory: Path) -> Path:
    path = directory / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    return path


async def post_stream(client: Any, path: str, body: dict[str, Any]) -> list[Any]:
    """A streamed request's payloads, read as they arrive (the test client's `post` buffers only
    a few chunks): SSE `data:` payloads, or Anthropic / Responses events as (name, payload)."""
    raw = b""
    async with client.request(path, method="POST", headers=JSON) as conn:
        await conn.send(json.dumps({**body, "stream": True}).encode())
        await conn.send_complete()
        while True:
            try:
                data = await conn.receive()
            except trio.EndOfChannel:
                break
            assert conn.status_code == 200, data
            raw += data
    text = raw.decode()
    if "event: " not in text:
        return sse_payloads(raw)
    events = []
    for frame in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events
