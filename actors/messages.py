"""Every message that crosses an actor boundary, as frozen attrs classes.

Data flows left → right in the order a request lives:

    request ──Submit──▶ admission ──Enqueue──▶ scheduler ──RowEvent (per-row channel)──▶ request
    request ◀──Admitted | Rejected── admission
    request ──Abort | StopRow (control, unbounded)──▶ scheduler

A per-row channel carries `RowOpened` once (cached-prompt accounting), then `TokenOut`s, or a
`RowFailed`; the scheduler closing its send end is the end of the row.

A `RequestObserver` rides along with `Submit` and `Enqueue`: each actor tells it what it did to
the request (request logs, metrics and traces subscribe this way, never by wrapping channels).
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs
import trio

from cache.spill_item import SpillItem
from model.engine.params import SamplingParams
from model.engine.rows import ImageInput, RowOpened, RowSpec, TokenOut

Lane = Literal["serial", "batched"]


@attrs.frozen
class Siblings:
    """One of the `count` choices of one request (OpenAI's `n`): rows with one prompt that share
    one prefill. Choice `index` 0 leads: the scheduler holds it until the others have arrived,
    prefills it, then forks its KV into them."""

    key: int  # the same for every choice of the request, unique among requests
    index: int
    count: int


@attrs.frozen
class GenerationRequest:
    """A request after protocol parsing and templating: plain token ids and sampling values."""

    prompt: tuple[int, ...]
    sampling: SamplingParams  # `seed` is filled in by admission
    max_tokens: int  # what the client asked for (or the route default), before the clamp
    seed: int | None = None
    namespace: str = ""
    snapshot_at: int | None = None  # template-stable prefix (cache/boundary.py), chat only
    retain: tuple[tuple[int, float], ...] = ()  # a client's retention hints: (prompt position, seconds)
    siblings: Siblings | None = None  # one of several choices sharing one prefill
    adapters: tuple[str, ...] = ()  # LoRA adapter ids stacked for the row (checked mounted by the route)
    images: tuple[ImageInput, ...] = ()  # preprocessed images for the prompt's image-pad runs (api/images.py)


class RequestObserver(Protocol):
    """Lifecycle events of one request, told by the actor that caused them. Synchronous and
    cheap: an observer must never block or raise (it runs inside actor loops)."""

    def submitted(self, prompt: tuple[int, ...]) -> None:
        """The request actor sent its `Submit`."""

    def decided(self, decision: Admitted | Rejected) -> None:
        """Admission's answer reached the requester."""

    def left_before_answer(self) -> None:
        """Admitted, but the requester was gone before the answer reached it."""

    def row_event(self, event: RowEvent) -> None:
        """The scheduler delivered an event on the row's channel."""

    def prefilled(self, started: float, done: int, remaining: int, rows: int) -> None:
        """A prefill forward of the row ran from `started` (trio time) to now: `done` prompt tokens
        are in its KV, `remaining` still to go; `rows` > 1 for a group prefill (the trace's chunks)."""

    def row_ended(self) -> None:
        """The scheduler closed the row's channel: a later abort cuts nothing."""

    def preempted(self) -> None:
        """The scheduler took the running row out of the batch to make room (the live-KV budget):
        it resumes from the prompt cache, its stream paused meanwhile."""

    def aborted(self) -> None:
        """The request actor aborted its row (a client disconnect, the shutdown cut-off)."""

    def finished(self, reason: str) -> None:
        """The text pipeline's finish reason: what the client is told."""


class NullObserver:
    """Observes nothing: a request outside any HTTP request (tests, warm-ups)."""

    def submitted(self, prompt: tuple[int, ...]) -> None:
        pass

    def decided(self, decision: Admitted | Rejected) -> None:
        pass

    def left_before_answer(self) -> None:
        pass

    def row_event(self, event: RowEvent) -> None:
        pass

    def prefilled(self, started: float, done: int, remaining: int, rows: int) -> None:
        pass

    def row_ended(self) -> None:
        pass

    def preempted(self) -> None:
        pass

    def aborted(self) -> None:
        pass

    def finished(self, reason: str) -> None:
        pass


NULL_OBSERVER: RequestObserver = NullObserver()


@attrs.frozen(eq=False)
class Submit:
    request: GenerationRequest
    rows: trio.MemorySendChannel  # per-row channel, handed on to the scheduler
    reply: trio.MemorySendChannel  # buffer 1: Admitted | Rejected
    observer: RequestObserver = NULL_OBSERVER


@attrs.frozen
class Admitted:
    row_id: int
    max_tokens: int  # after the memory-budget clamp
    lane: Lane
    seed: int


@attrs.frozen
class Rejected:
    status: int
    message: str
    type: str
    code: str | None = None
    retry_after: float | None = None  # seconds, sent as Retry-After on 503


@attrs.frozen(eq=False)
class Enqueue:
    spec: RowSpec
    lane: Lane
    rows: trio.MemorySendChannel  # RowEvent items; the scheduler closes it when the row ends
    observer: RequestObserver = NULL_OBSERVER
    siblings: Siblings | None = None


@attrs.frozen
class Abort:
    """The request is gone (client disconnect, shutdown cut-off): never deliver another token."""

    row_id: int


@attrs.frozen
class StopRow:
    """The text pipeline matched a stop string: the row ends cleanly at the next boundary."""

    row_id: int


@attrs.frozen
class RowFailed:
    row_id: int
    message: str
    status: int = 500  # 400: the request's own mistake (an adapter unmounted before its row opened)


@attrs.frozen
class WorkerLost:
    """The worker lost every row it had opened (an isolated engine process died: actors/isolate/):
    they fail now, each stream with `error`, not at their next call (after the engine's restart)."""

    error: Exception


RowEvent = RowOpened | TokenOut | RowFailed
Control = Enqueue | Abort | StopRow | WorkerLost


# --- the prompt cache's SSD tier: durability → spill queue → SSD store ------------------------
#
#   GPU-worker (PromptCache.put hook) ──MarkDirty──▶ durability ──Spill──▶ spill_queue ──▶ disk
#   demotion_timer ──Spill──▶ spill_queue;  spill_queue ──SpillDone (per Spill)──▶ its sender


@attrs.frozen
class MarkDirty:
    """A RAM prompt-cache entry keyed exactly by `tokens` was put: make it durable."""

    namespace: str
    tokens: tuple[int, ...]


@attrs.frozen(eq=False)
class Spill:
    item: SpillItem  # exact tokens + materialized KV views + namespace
    reply: trio.MemorySendChannel | None = None  # buffer >= 1: one SpillDone; None = fire and forget


@attrs.frozen
class SpillDone:
    stored: bool
    reason: str = ""  # "stored" | "dropped" | "refused" | "failed" | "cancelled"


@attrs.frozen
class FlushResult:
    """What a durability flush achieved; durable ⇔ everything dirty reached disk."""

    durable: bool
    flushed_snapshots: int = 0
    missing_snapshots: int = 0
    pending_snapshots: int = 0
    pending_spills: int = 0
    pending_spill_bytes: int = 0
    dropped_spills: int = 0
    failed_spills: int = 0
    elapsed_ms: float = 0.0
