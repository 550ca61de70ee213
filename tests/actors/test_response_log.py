"""The durable Responses store (actors/ssd/response_log.py) on MockClock, its blocking file work
run inline after a virtual delay (so batches form as they do on a thread): records survive a
restart verified, concurrent puts share one fsync'd batch, records expire and fall to the size
cap least recently used first, and a corrupt record is skipped with a log line, quarantined and
answered as absent, never served."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.ssd.response_log import ResponseLog
from actors.ssd.response_records import QUARANTINE, RecordDir, StoreUnavailable, decode, encode

IO_S = 0.01  # what one blocking call takes, in virtual time
EPOCH = 2_000_000_000.0


def wall() -> float:
    return EPOCH + trio.current_time()


async def inline(fn: Any) -> Any:
    await trio.sleep(IO_S)
    return fn()


def new_log(root: Path, **kw: Any) -> ResponseLog:
    kw.setdefault("ttl_s", 3600.0)
    kw.setdefault("max_bytes", 1 << 20)
    return ResponseLog(RecordDir(root), clock=wall, run_blocking=inline, **kw)


def fields(text: str) -> dict[str, Any]:
    return {
        "input": [
            {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        ],
        "output": [{"id": "msg_2", "type": "message", "role": "assistant", "content": []}],
        "instructions": None,
        "response": {"id": "x", "object": "response", "text": text},
    }


async def started(nursery: trio.Nursery, root: Path, **kw: Any) -> ResponseLog:
    store = await new_log(root, **kw).open()
    await nursery.start(store.run)
    return store


async def test_a_put_is_on_disk_when_it_returns_and_a_restart_reads_it_back(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        record = store.record("resp_ab12", **fields("hello"))
        assert await store.put(record)
        [path] = tmp_path.glob("*/resp_ab12.json")
        assert decode(path.read_bytes(), "resp_ab12") == record  # on disk, verified, before any flush
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        again = await started(nursery, tmp_path)
        assert await again.get("resp_ab12") == record
        assert await again.get("resp_none") is None and again.counters.reads == 1
        nursery.cancel_scope.cancel()


async def test_concurrent_puts_share_one_fsyncd_batch(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        results: list[bool] = []

        async def put(i: int) -> None:
            results.append(await store.put(store.record(f"resp_{i:04d}", **fields(str(i)))))

        async with trio.open_nursery() as puts:
            puts.start_soon(put, 0)
            await trio.sleep(IO_S / 2)  # the first batch is on its thread: the rest queue behind it
            for i in range(1, 6):
                puts.start_soon(put, i)
        assert results == [True] * 6
        assert (store.counters.batches, store.counters.last_batch, store.counters.writes) == (2, 5, 6)
        assert len(list(tmp_path.glob("*/resp_*.json"))) == 6
        nursery.cancel_scope.cancel()


async def test_records_expire_at_their_ttl_and_the_sweep_removes_their_files(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path, ttl_s=100.0, sweep_s=30.0)
        await store.put(store.record("resp_old1", **fields("old")))
        await trio.sleep(50)
        await store.put(store.record("resp_new1", **fields("new")))
        await trio.sleep(51)  # the first is past its 100 s; the sweep has not run since
        assert await store.get("resp_old1") is None and await store.get("resp_new1") is not None
        await trio.sleep(30)
        await store.drain()
        assert [p.name for p in tmp_path.glob("*/resp_*.json")] == ["resp_new1.json"]
        assert store.counters.expired == 1
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:  # a restart past the second's ttl finds nothing
        await trio.sleep(100)
        assert len((await started(nursery, tmp_path, ttl_s=100.0)).index) == 0
        nursery.cancel_scope.cancel()


async def test_over_the_size_cap_the_least_recently_used_go_first(tmp_path, autojump_clock):
    size = len(encode(new_log(tmp_path / "probe").record("resp_0000", **fields("0"))))
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path, max_bytes=3 * size + size // 2)  # room for three
        for i in range(3):
            await store.put(store.record(f"resp_{i:04d}", **fields(str(i))))
            await trio.sleep(1)
        assert await store.get("resp_0000") is not None  # read: now the most recently used
        await store.put(store.record("resp_0003", **fields("3")))
        await store.drain()
        assert sorted(store.index) == ["resp_0000", "resp_0002", "resp_0003"]
        assert sorted(p.name for p in tmp_path.glob("*/resp_*.json")) == [f"{r}.json" for r in sorted(store.index)]
        assert store.counters.evicted == 1
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["body", "header", "truncated"])
async def test_a_corrupt_record_is_skipped_at_start_with_a_log_line(tmp_path, autojump_clock, caplog, where):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        for rid in ("resp_good", "resp_evil"):
            await store.put(store.record(rid, **fields(rid)))
        nursery.cancel_scope.cancel()
    [path] = tmp_path.glob("*/resp_evil.json")
    data = bytearray(path.read_bytes())
    if where == "truncated":
        data = data[:-5]
    else:
        data[len(data) - 10 if where == "body" else 30] ^= 0x01
    path.write_bytes(bytes(data))
    (path.parent / ".resp_torn.json.1-1.tmp").write_bytes(b"half a rec")  # a write a crash cut
    caplog.set_level(logging.WARNING, "actors.ssd.response_records")
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        assert await store.get("resp_evil") is None and await store.get("resp_good") is not None
        assert store.counters.corrupt == 1 and store.records.reaped_temp == 1
        nursery.cancel_scope.cancel()
    assert "skipped a corrupt record resp_evil.json" in caplog.text
    assert not path.exists() and len(list((tmp_path / QUARANTINE).iterdir())) == 1


async def test_a_record_corrupted_after_start_is_never_served(tmp_path, autojump_clock, caplog):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        await store.put(store.record("resp_flip", **fields("flip")))
        [path] = tmp_path.glob("*/resp_flip.json")
        path.write_bytes(path.read_bytes().replace(b"flip", b"flop"))
        assert await store.get("resp_flip") is None
        assert "resp_flip" not in store.index and store.counters.corrupt == 1
        assert await store.get("resp_flip") is None
        nursery.cancel_scope.cancel()
    assert "skipped a corrupt record resp_flip.json" in caplog.text


async def test_delete_is_durable_and_a_second_server_cannot_open_the_directory(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        store = await started(nursery, tmp_path)
        await store.put(store.record("resp_gone", **fields("gone")))
        with pytest.raises(StoreUnavailable, match="in use by another server"):
            await new_log(tmp_path).open()
        assert await store.delete("resp_gone") and not await store.delete("resp_gone")
        assert not await store.delete("../../etc/passwd")  # never a path outside the store
        assert list(tmp_path.glob("*/resp_*.json")) == []
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        assert await (await started(nursery, tmp_path)).get("resp_gone") is None
        nursery.cancel_scope.cancel()
