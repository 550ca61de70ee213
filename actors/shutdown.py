"""The shutdown signal shared by the entry point, the root and the tests."""

from __future__ import annotations

import attrs
import trio


@attrs.define
class Shutdown:
    """Set by the signal watcher (or a test): first `requested`, on a second signal `now`."""

    requested: trio.Event = attrs.Factory(trio.Event)
    now: trio.Event = attrs.Factory(trio.Event)
    requested_at: float | None = None

    def request(self) -> None:
        if not self.requested.is_set():
            self.requested_at = trio.current_time()
            self.requested.set()
        else:
            self.now.set()
