"""A real server on a real socket in a background thread, over scripted checkpoints (the SDK tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from actors.gpu_worker import GpuWorker
from model.text.tokenizer import Tokenizer
from tests.fixtures.synth import write_scripted_model_dir
from tests.helpers.workers import gpu_worker
from tests.live_http import serve_in_thread

TEXT_SCRIPT = ("Hello", " from", " a", " scripted", " model", ".")


THINK_SCRIPT = ("<think>", "Let me", " think.", "</think>", "The answer", " is 42.")


WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


TOOL_SCRIPT = ("I will check.", "<tool_call>", WEATHER_CALL, "</tool_call>")


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class FailingWorker:
    """The real worker, except that `step()` raises once `fail_in` more steps have run (armed
    from the test thread; a plain attribute, so no locking is needed)."""

    def __init__(self, inner: GpuWorker) -> None:
        self.inner = inner
        self.fail_in: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def step(self) -> Any:
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in <= 0:
                self.fail_in = None
                raise RuntimeError("injected engine failure")
        return await self.inner.step()


@attrs.frozen(eq=False)
class Live:
    base: str  # http://127.0.0.1:<port>
    tokenizer: Tokenizer
    worker: Any

    def sse(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> list[tuple[str | None, dict]]:
        """(event, payload) per frame of a streamed response, read raw."""
        response = httpx.post(self.base + path, json={**body, "stream": True}, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        out = []
        for frame in response.text.split("\n\n"):
            if frame.strip():
                lines = dict(line.split(": ", 1) for line in frame.split("\n"))
                out.append((lines.get("event"), json.loads(lines["data"])))
        return out


@contextmanager
def live_server(model_dir: Path, *, failing: bool = False, prompt_cache_bytes: int = 64 << 20) -> Iterator[Live]:
    inner = gpu_worker(model_dir, prompt_cache_gb=prompt_cache_bytes / 2**30)
    worker = FailingWorker(inner) if failing else inner
    # served as "m", the name these tests' (and test_responses_sdk's) requests carry
    with serve_in_thread(model_dir, worker=worker, served_model_name=("m",)) as base:
        yield Live(base, Tokenizer.from_dir(model_dir), worker)


def scripted(tmp_path_factory: pytest.TempPathFactory, name: str, script: Sequence[str]) -> Path:
    return write_scripted_model_dir(tmp_path_factory.mktemp(name), list(script))
