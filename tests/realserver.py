"""A real in-process server for real-engine tests: the real GPU worker (one MLX thread), the real
scheduler and admission (`actors.root.start_actors`), the real quart-trio app, driven through
quart-trio's test client (no sockets).

`RecordingWorker` wraps the real `GpuWorker`: every call is delegated unchanged and logged as
`Call(seq, name, row_id, result, started, ended)`, so tests can see what the scheduler asked of the
worker (which rows got which token ids, how many prefill chunks ran between two decode steps, how
wide each step was) without reaching into the engine.

Real threads do real work here, so these tests use the real clock (never `autojump_clock`) and
wrap themselves in a generous `trio.fail_after`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from actors.gpu_worker import GpuWorker
from actors.handles import ServerHandles
from actors.options import options as serve_options
from actors.root import start_actors
from actors.worker_api import AdapterReport, ModelInfo
from api.app import create_app
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.text.tokenizer import Tokenizer
from tests.helpers.workers import gpu_worker

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


@attrs.define
class Call:
    seq: int
    name: str  # open_row | prefill | join | step | close_row | run_exclusive
    row_id: int | None
    result: Any = None
    started: float = 0.0
    ended: float | None = None


class RecordingWorker:
    """The real worker, every call delegated and logged (same interface as `GpuWorker`)."""

    def __init__(self, inner: GpuWorker) -> None:
        self.inner = inner
        self.calls: list[Call] = []
        self.specs: dict[int, RowSpec] = {}

    # Read by `start_actors` for /stats (the real PromptCache, created on the MLX thread).
    @property
    def prompt_cache(self) -> Any:
        return self.inner.prompt_cache

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        await self.inner.run(task_status=task_status)

    async def _record(self, name: str, row_id: int | None, call: Callable[[], Any]) -> Any:
        entry = Call(len(self.calls), name, row_id, started=trio.current_time())
        self.calls.append(entry)
        entry.result = await call()
        entry.ended = trio.current_time()
        return entry.result

    async def open_row(self, spec: RowSpec) -> RowOpened:
        self.specs[spec.row_id] = spec
        return await self._record("open_row", spec.row_id, lambda: self.inner.open_row(spec))

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        return await self._record("prefill", row_id, lambda: self.inner.prefill(row_id, max_tokens))

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]:
        return await self._record("prefill_group", None, lambda: self.inner.prefill_group(row_ids))

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]:
        self.specs.update((spec.row_id, spec) for spec in specs)
        return await self._record("fork_rows", source_id, lambda: self.inner.fork_rows(source_id, specs))

    async def join(self, row_id: int) -> TokenOut:
        return await self._record("join", row_id, lambda: self.inner.join(row_id))

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]:
        # one row (a joiner riding the next step) is recorded under its id, a group under None
        row_id = row_ids[0] if len(row_ids) == 1 else None
        return await self._record("join_group", row_id, lambda: self.inner.join_group(row_ids))

    async def step(self) -> list[TokenOut]:
        return await self._record("step", None, self.inner.step)

    def abort(self, row_id: int) -> None:
        self.inner.abort(row_id)  # a signal, not a job: nothing to record

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        return await self._record(
            "close_row", row_id, lambda: self.inner.close_row(row_id, reusable=reusable, retain_s=retain_s)
        )

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        return await self._record("mount_adapter", None, lambda: self.inner.mount_adapter(adapter_id, path))

    async def unmount_adapter(self, adapter_id: str) -> bool:
        return await self._record("unmount_adapter", None, lambda: self.inner.unmount_adapter(adapter_id))

    async def embed(self, inputs: list[list[int]], *, dimensions: int | None = None) -> list[list[float]]:
        return await self._record("embed", None, lambda: self.inner.embed(inputs, dimensions=dimensions))

    async def run_exclusive(self, fn: Callable[[Any], Any]) -> Any:
        return await self._record("run_exclusive", None, lambda: self.inner.run_exclusive(fn))

    async def score(self, tokens: list[int], *, top: int = 0, adapters: tuple[str, ...] = ()) -> Any:
        return await self._record("score", None, lambda: self.inner.score(tokens, top=top, adapters=adapters))

    async def machine(self) -> Any:
        return await self.inner.machine()

    @property
    def times(self) -> Any:  # the worker's time accounting (/stats, GET /fit)
        return self.inner.times

    # -- views over the log

    def tokens_by_row(self) -> dict[int, list[int]]:
        """Every token the worker produced for each row, in order (join's token 0, then steps)."""
        out: dict[int, list[int]] = {}
        for call in self.calls:
            if call.name == "join" and call.result is not None and call.row_id is not None:
                out.setdefault(call.row_id, []).append(call.result.token)
            elif call.name == "join_group" and call.result is not None:
                for token in call.result:
                    if token is not None:
                        out.setdefault(token.row_id, []).append(token.token)
            elif call.name == "step" and call.result is not None:
                for token in call.result:
                    out.setdefault(token.row_id, []).append(token.token)
        return out

    def row_for_prompt(self, prompt: tuple[int, ...]) -> list[int]:
        return [rid for rid, spec in self.specs.items() if spec.prompt == tuple(prompt)]

    def settled(self) -> bool:
        """No call in flight and every opened row closed (its close_row job has returned)."""
        closed = {c.row_id for c in self.calls if c.name == "close_row" and c.ended is not None}
        return all(c.ended is not None for c in self.calls) and set(self.specs) <= closed

    def step_widths(self) -> list[int]:
        return [len(c.result) for c in self.calls if c.name == "step" and c.result is not None]


@attrs.frozen(eq=False)
class RealServer:
    client: Any  # quart-trio test client
    handles: ServerHandles
    worker: RecordingWorker
    tokenizer: Tokenizer

    async def stats(self) -> dict[str, Any]:
        return await (await self.client.get("/stats")).get_json()

    async def health(self) -> tuple[int, bytes]:
        response = await self.client.get("/health")
        return response.status_code, await response.get_data()


@asynccontextmanager
async def real_server(
    model_dir: Path,
    *,
    batch: int = 8,
    prefill_chunk: int = 2048,
    prompt_cache_bytes: int = 0,
    eos_token_ids: Any = None,
    paged_kv: bool = False,
    **config: Any,
) -> AsyncIterator[RealServer]:
    worker = RecordingWorker(
        gpu_worker(
            model_dir,
            prefill_chunk=prefill_chunk,
            prompt_cache_gb=prompt_cache_bytes / 2**30,
            eos_token_ids=eos_token_ids,
            paged_kv=paged_kv,
        )
    )
    tokenizers: list[Tokenizer] = []

    def make_tokenizer(info: ModelInfo) -> Tokenizer:
        tokenizers.append(Tokenizer.from_dir(Path(model_dir), eos_token_ids_from_config=info.eos_token_ids))
        return tokenizers[-1]

    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            worker,
            options=serve_options(batch=batch, prompt_cache_gb=prompt_cache_bytes / 2**30, paged_kv=paged_kv, **config),
            make_tokenizer=make_tokenizer,
        )
        yield RealServer(create_app(handles).test_client(), handles, worker, tokenizers[0])
        nursery.cancel_scope.cancel()


# -- HTTP helpers -------------------------------------------------------------------------------


def sse_payloads(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, with "[DONE]" kept as the string."""
    frames = [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f.strip()]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


@attrs.define
class Streamed:
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    done: bool = False  # saw [DONE]
    cut: bool = False  # the client disconnected on purpose


def _absorb(result: Streamed, payload: Any, *, chat: bool) -> None:
    if payload == "[DONE]":
        result.done = True
        return
    assert "error" not in payload, payload
    if not payload["choices"]:  # include_usage: the last chunk has the usage and no choice
        result.usage = payload["usage"]
        return
    result.chunks += 1
    choice = payload["choices"][0]
    result.text += (choice.get("delta", {}).get("content") or "") if chat else choice["text"]
    if choice.get("finish_reason") is not None:
        result.finish_reason = choice["finish_reason"]


async def complete(server: RealServer, body: dict[str, Any], *, chat: bool = False) -> Streamed:
    """A streamed request read to its end (read as it arrives: the test client's `post` buffers
    only 10 body chunks before the app blocks)."""
    return await stream(server, body, chat=chat)


async def complete_whole(server: RealServer, body: dict[str, Any], *, chat: bool = False) -> dict[str, Any]:
    response = await server.client.post(CHAT if chat else COMPLETIONS, json={**body, "stream": False})
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


async def stream(
    server: RealServer,
    body: dict[str, Any],
    *,
    chat: bool = False,
    cut_after: int | None = None,
    on_chunk: Callable[[Streamed], None] | None = None,
) -> Streamed:
    """Stream one request; with `cut_after`, disconnect after that many chunks (a client going
    away mid-stream). `on_chunk` sees the result after every chunk."""
    result = Streamed()
    async with server.client.request(CHAT if chat else COMPLETIONS, method="POST", headers=JSON) as conn:
        usage = {"stream_options": {"include_usage": True}}  # `Streamed.usage` comes from its last chunk
        await conn.send(json.dumps({**usage, **body, "stream": True}).encode())
        await conn.send_complete()
        buffer = b""
        while not result.done and (cut_after is None or result.chunks < cut_after):
            try:
                data = await conn.receive()
            except trio.EndOfChannel:
                break
            assert conn.status_code == 200, data
            buffer += data
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if frame.strip():
                    text = frame.decode().removeprefix("data: ")
                    _absorb(result, text if text == "[DONE]" else json.loads(text), chat=chat)
                    if on_chunk is not None:
                        on_chunk(result)
        if not result.done:
            await conn.disconnect()
            result.cut = True
            conn._client_send.close()  # quart-trio's test client hangs on a disconnect unless its send side is closed
    return result


async def wait_until(predicate: Callable[[], bool], *, poll: float = 0.005) -> None:
    while not predicate():
        await trio.sleep(poll)
