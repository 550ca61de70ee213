"""An isolated engine answers a row call from its MLX thread (actors/isolate/host.py, the link's
`post_from_thread`): over a real socket pair, every frame arrives whole and in order even when
the socket's buffer forces partial writes from both threads, each call gets exactly one answer
(a value or its exception), even when the call's task never returns."""

from __future__ import annotations

import socket
import threading

import pytest
import trio

from actors.isolate import protocol as link_module
from actors.isolate.host import serve_engine
from actors.isolate.link import Link
from actors.mlx_thread import MlxThread
from actors.options import options
from actors.worker_api import ModelInfo
from model.engine.params import SamplingParams
from model.engine.rows import RowOpened, RowSpec, TokenOut


def _pair(buffer: int | None = None) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        if buffer is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        s.setblocking(False)
    return a, b


def _stream(s: socket.socket) -> trio.SocketStream:
    return trio.SocketStream(trio.socket.from_stdlib_socket(s))


async def test_frames_from_two_threads_arrive_whole_and_in_order():
    a, b = _pair(buffer=4096)  # (frames of ~20 kB: every one is a partial write)
    got: list[tuple[str, int]] = []
    done = trio.Event()
    per_side = 60

    def on_message(head):
        got.append((head["who"], head["n"]))
        if len(got) == 2 * per_side:
            done.set()

    sender, receiver = Link(_stream(a), sock=a), Link(_stream(b), on_message, sock=b)
    async with trio.open_nursery() as nursery:
        await nursery.start(sender.run)
        await nursery.start(receiver.run)
        pad = "x" * 20_000

        def from_thread() -> None:
            for n in range(per_side):
                sender.post_from_thread({"who": "thread", "n": n, "pad": pad})

        thread = threading.Thread(target=from_thread)
        thread.start()
        for n in range(per_side):
            sender.post({"who": "trio", "n": n, "pad": pad})
            await trio.sleep(0)
        await trio.to_thread.run_sync(thread.join)
        with trio.fail_after(10):
            await done.wait()
            await sender.flush()
        sender.close("done")
        receiver.close("done")
    for who in ("thread", "trio"):
        assert [n for w, n in got if w == who] == list(range(per_side))


class ThreadWorker:
    """Row calls as jobs on an MLX thread, as actors/gpu_worker.py runs them; a step's task then
    never returns, so its answer can only come from the MLX thread."""

    def __init__(self) -> None:
        self.thread = MlxThread("test-mlx")
        self.info = ModelInfo(
            name="t", context_length=64, weights_bytes=0, kv_bytes_per_token=0, eos_token_ids=frozenset()
        )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.thread.run)
            task_status.started(self.info)
            await trio.sleep_forever()

    async def open_row(self, spec: RowSpec) -> RowOpened:
        return await self.thread.call(lambda: RowOpened(spec.row_id, 0, len(spec.prompt)), "open_row")

    async def step(self) -> list[TokenOut]:
        await self.thread.call(lambda: [TokenOut(1, 7)], "step")
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        def job() -> None:
            if row_id == 99:
                raise KeyError(row_id)

        return await self.thread.call(job, "close_row")

    def abort(self, row_id: int) -> None:
        pass


async def test_row_calls_are_answered_once_from_the_mlx_thread(monkeypatch):
    ours, theirs = _pair()
    worker = ThreadWorker()
    replies: list[int] = []

    def counting(payload: bytes) -> dict:
        head = link_module.parse(payload)
        if "r" in head:
            replies.append(head["r"])
        return head

    monkeypatch.setattr("actors.isolate.link.parse", counting)
    hello = trio.Event()
    link = Link(_stream(ours), lambda head: hello.set(), sock=ours)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        nursery.start_soon(serve_engine, _stream(theirs), worker, options(), lambda: None, theirs)
        try:
            with trio.fail_after(10):
                await _calls(link, hello)
        finally:
            link.close("done")
    assert sorted(replies) == list(range(1, 24))  # (one answer per call, none twice)


async def _calls(link: Link, hello: trio.Event) -> None:
    await hello.wait()
    opened = await link.call("open_row", RowSpec(1, (1, 2, 3), SamplingParams(), max_tokens=4))
    assert opened == RowOpened(1, 0, 3)
    for _ in range(20):  # (answered though each step's task never returns)
        assert await link.call("step") == [TokenOut(1, 7)]
    await link.call("close_row", 1, reusable=True)
    with pytest.raises(KeyError, match="99"):
        await link.call("close_row", 99, reusable=False)
    await trio.sleep(0.05)  # (a second answer to any call would arrive meanwhile)
    link.post({"stop": True})
    await link.flush()
