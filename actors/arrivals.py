"""Requests on their way in: counted while a generation route reads, parses and templates them.

A lone row at the head of the queue is prefilled alone, though requests of the same burst may be
a few milliseconds behind it, still being read, parsed and templated on the event loop: had it
waited for them, they would have shared one group prefill. The scheduler reads `pending` to tell
the two cases apart and holds such a head for at most its arrival window.

A route counts itself from its first line until admission has answered it. Admission sends the
row's Enqueue before its answer, so by the time a count drops the row is in the scheduler's inbox
(or the request was refused, or never got that far: a 400, a disconnect mid-body).

No channels: a plain counter on the event loop, entered by the routes (`arriving()`), read by
the scheduler (`pending`), which `on_settled` nudges each time an arrival settles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class Arrivals:
    def __init__(self) -> None:
        self.pending = 0
        # Called each time an arrival settles: the scheduler re-decides.
        self.on_settled: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1
            self.on_settled()
