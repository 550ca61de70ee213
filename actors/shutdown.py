"""The shutdown signal shared by the entry point, the root and the tests, and the plan that owns
every deadline of a graceful shutdown."""

from __future__ import annotations

import attrs
import trio

from model.options import ServerOptions


@attrs.define
class Shutdown:
    """Set by the signal watcher (or a test): first `requested`, on a second signal `now`."""

    requested: trio.Event = attrs.Factory(trio.Event)
    now: trio.Event = attrs.Factory(trio.Event)

    def request(self) -> None:
        if not self.requested.is_set():
            self.requested.set()
        else:
            self.now.set()


@attrs.frozen
class ShutdownPlan:
    """Every phase deadline of a graceful shutdown, in seconds.

    From the first signal: admission closes (requests still queued get 503 at once) and the
    requests already generating get `drain` seconds, then are cut with a final chunk; the
    listener stays open, answering 503, until they have ended (at most `drain`). HTTP ends at
    `http_deadline`, `http_grace` past the drain so our final chunks are written first; once
    every admitted request has ended, HTTP ends `drained_http_grace` later instead (an idle
    keep-alive connection would otherwise hold it to its deadline). Then, with the SSD tier, the
    durability flush gets `durability_flush` seconds while the worker still runs; after the
    actors stop, the flush hooks get `flush_hooks` seconds.

    The watchdog hard-exits the process `watchdog` seconds after the first signal: a client that
    stopped reading pins its connection (hypercorn shields its socket writes, so no cancel frees
    it), and only `watchdog_slack` past the drain, HTTP and flush deadlines is left for that.
    A second signal cancels everything and hard-exits after `hard_exit_after` seconds.
    """

    drain: float = 30.0  # --shutdown-timeout
    http_grace: float = 2.0
    drained_http_grace: float = 0.5  # after the last generation: its final frames, short requests
    durability_flush: float = 0.0  # 0 without the SSD tier
    flush_hooks: float = 10.0
    watchdog_slack: float = 10.0
    hard_exit_after: float = 2.0

    @classmethod
    def for_options(cls, options: ServerOptions) -> ShutdownPlan:
        """The flush gets the drain's budget again when the SSD tier is on."""
        timeout = options.http.shutdown_timeout
        return cls(drain=timeout, durability_flush=timeout if options.caches.ssd_cache_dir else 0.0)

    @property
    def http_deadline(self) -> float:
        """Seconds from the first signal until HTTP is cancelled (and hypercorn's graceful timeout)."""
        return self.drain + self.http_grace

    @property
    def watchdog(self) -> float:
        return self.http_deadline + self.durability_flush + self.watchdog_slack
