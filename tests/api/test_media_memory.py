"""The media memory ledger (api/media.py `MediaMemory`): bills that fit run together, one that
does not waits until memory frees (never refused), first come first served, and a waiter that
leaves (a client gone) lets the ones behind it in. Virtual time: nothing here touches a thread."""

from __future__ import annotations

import pytest
import trio

from api.media import MediaMemory


class Holder:
    """A task holding `nbytes` until `release` is set; `entered` once it holds them."""

    def __init__(self, ledger: MediaMemory, nbytes: int) -> None:
        self.ledger, self.nbytes = ledger, nbytes
        self.entered = trio.Event()
        self.release = trio.Event()

    async def run(self) -> None:
        async with self.ledger.hold(self.nbytes):
            self.entered.set()
            await self.release.wait()


async def started(nursery: trio.Nursery, ledger: MediaMemory, nbytes: int) -> Holder:
    holder = Holder(ledger, nbytes)
    nursery.start_soon(holder.run)
    await trio.sleep(1)  # (virtual) every task has run as far as it can
    return holder


async def test_bills_that_fit_hold_together(autojump_clock):
    ledger = MediaMemory(100)
    async with trio.open_nursery() as nursery:
        a, b = await started(nursery, ledger, 60), await started(nursery, ledger, 40)
        assert a.entered.is_set() and b.entered.is_set() and ledger.used == 100 and ledger.waiting == 0
        a.release.set()
        b.release.set()
    assert ledger.used == 0


async def test_a_bill_that_does_not_fit_waits_until_memory_frees(autojump_clock):
    ledger = MediaMemory(100)
    async with trio.open_nursery() as nursery:
        a = await started(nursery, ledger, 70)
        b = await started(nursery, ledger, 50)
        assert not b.entered.is_set() and ledger.waiting == 1 and ledger.used == 70
        a.release.set()
        await trio.sleep(1)
        assert b.entered.is_set() and ledger.used == 50 and ledger.waiting == 0
        b.release.set()
    assert ledger.used == 0


async def test_first_come_first_served(autojump_clock):
    ledger = MediaMemory(100)
    async with trio.open_nursery() as nursery:
        a = await started(nursery, ledger, 70)
        b = await started(nursery, ledger, 50)
        c = await started(nursery, ledger, 10)  # would fit now, but b came first
        assert not c.entered.is_set() and ledger.waiting == 2
        a.release.set()
        await trio.sleep(1)
        assert b.entered.is_set() and c.entered.is_set() and ledger.used == 60
        b.release.set()
        c.release.set()
    assert ledger.used == 0


async def test_a_waiter_that_leaves_lets_the_next_in(autojump_clock):
    ledger = MediaMemory(100)
    async with trio.open_nursery() as nursery:
        a = await started(nursery, ledger, 70)
        gone = trio.CancelScope()  # the client of the request holding b
        b = Holder(ledger, 50)
        nursery.start_soon(_run_in, gone, b)
        await trio.sleep(1)
        assert ledger.waiting == 1
        c = await started(nursery, ledger, 20)
        assert ledger.waiting == 2 and not c.entered.is_set()
        gone.cancel()
        await trio.sleep(1)
        assert not b.entered.is_set() and c.entered.is_set() and ledger.used == 90 and ledger.waiting == 0
        a.release.set()
        c.release.set()
    assert ledger.used == 0


async def _run_in(scope: trio.CancelScope, holder: Holder) -> None:
    with scope:
        await holder.run()


async def test_a_holder_that_fails_gives_its_bytes_back(autojump_clock):
    ledger = MediaMemory(100)
    with pytest.raises(RuntimeError):
        async with ledger.hold(80):
            raise RuntimeError("decode failed")
    assert ledger.used == 0
    async with ledger.hold(100):
        assert ledger.used == 100


async def test_a_bill_over_the_capacity_is_refused_at_once(autojump_clock):
    ledger = MediaMemory(100)
    with pytest.raises(ValueError, match="cannot fit"):
        async with ledger.hold(101):
            pass
    assert ledger.used == 0 and ledger.waiting == 0
