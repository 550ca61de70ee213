"""Test doubles for the actor layer: a GPU worker that runs inline and spends virtual time.

`FakeWorker` implements `actors.worker_api.Worker` with `await trio.sleep(cost)` per call, so
under `autojump_clock` every timestamp is exact. Its tokens are a pure function of
(prompt, position) — never of the batch — so "batched output equals solo output" is checkable,
and it records every call and any protocol violation (a call while another runs, a prefill of
a row that is not opening, a step over a finished row, ...).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from actors.arrivals import Arrivals
from actors.kv_memory import KvBudget
from actors.messages import NULL_OBSERVER, Enqueue, Lane, RequestObserver
from actors.scheduler import Scheduler
from actors.worker_api import AdapterNotMounted, AdapterReport, ModelInfo, NotAnEmbeddingModel
from model.engine.params import SamplingParams
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.load.embedding_config import plan_jobs
from model.text.chat_template import ChatTemplate
from model.text.detokenizer import TextStream
from model.text.tokenizer import ChatTokenizer

EOS = 0


def default_token(prompt: tuple[int, ...], position: int) -> int:
    key = sum((i + 1) * t for i, t in enumerate(prompt)) % 1009
    return 1 + (key * 31 + position * 7919) % 997  # never EOS


@attrs.define
class _FakeRow:
    spec: RowSpec
    done: int = 0  # prompt tokens prefilled
    generated: int = 0
    joined: bool = False
    finished: bool = False
    aborted: bool = False  # a prefill of it stopped on `abort`: it may only close


class FakeWorker:
    def __init__(
        self,
        *,
        chunk: int = 4,
        open_cost: float = 0.0,
        prefill_cost: float = 1.0,
        join_cost: float = 1.0,
        step_cost: float = 1.0,
        close_cost: float = 0.0,
        token_fn: Callable[[tuple[int, ...], int], int] = default_token,
        eos_at: Callable[[RowSpec], int | None] = lambda spec: None,
        fail_step_at: int | None = None,
        info: ModelInfo | None = None,
        spec_at: Callable[[RowSpec, int], tuple[int, int]] = lambda spec, position: (0, 0),
    ) -> None:
        self.chunk = chunk
        self.open_cost, self.prefill_cost, self.join_cost = open_cost, prefill_cost, join_cost
        self.step_cost, self.close_cost = step_cost, close_cost
        self.token_fn = token_fn
        self.eos_at = eos_at
        self.fail_step_at = fail_step_at
        # Speculative decoding's report on the token at a position: (drafted, accepted).
        self.spec_at = spec_at
        self.info = info or ModelInfo(
            name="fake-model",
            context_length=4096,
            weights_bytes=1_000_000,
            kv_bytes_per_token=1000,
            eos_token_ids=frozenset({EOS}),
            memory_bytes=10**12,
        )
        self.rows: dict[int, _FakeRow] = {}
        self.specs: dict[int, RowSpec] = {}  # every row ever opened
        self.calls: list[tuple[float, str, Any]] = []  # (start time, call, row id or batch ids)
        self.closed: dict[int, tuple[float, bool]] = {}  # row id -> (time, reusable)
        self.violations: list[str] = []
        self.prefill_limits: list[int | None] = []  # each prefill call's max_tokens
        self.aborts: dict[int, float] = {}  # row id -> when `abort` reached the worker
        # The prefill running now: its rows, and the event that ends it early once all are aborted.
        self._prefilling: tuple[tuple[int, ...], trio.Event] | None = None
        self._busy = False
        self._steps = 0
        # LoRA adapters: what is mounted (a path containing "bad" cannot mount), and the ids still
        # used by open rows after their unmount (they leave with the last such row).
        self.adapter_cost = 0.0
        self.adapters: dict[str, AdapterReport] = {}
        self.leaving_adapters: set[str] = set()
        self.embed_cost = 0.0  # virtual seconds per embedding job

    async def run(self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self.info)
        await trio.sleep_forever()

    # -- the Worker interface

    async def open_row(self, spec: RowSpec) -> RowOpened:
        async with self._call("open_row", spec.row_id, self.open_cost):
            self._check_adapters(spec)
            if spec.row_id in self.rows:
                self.violations.append(f"open_row({spec.row_id}) twice")
            self.rows[spec.row_id] = _FakeRow(spec)
            self.specs[spec.row_id] = spec
            return RowOpened(spec.row_id, cached_tokens=0, to_prefill=len(spec.prompt) - 1)

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress:
        async with self._call("prefill", row_id, self.prefill_cost, stoppable=(row_id,)):
            row = self._row(row_id, "prefill")
            total = len(row.spec.prompt) - 1
            if row.joined or row.done >= total or row.aborted:
                self.violations.append(f"prefill({row_id}) with nothing to prefill")
            if row_id in self.aborts:  # stopped midway, as the engine's forward does: nothing kept
                row.aborted = True
                return PrefillProgress(row_id, done=0, remaining=total)
            self.prefill_limits.append(max_tokens)
            row.done = min(total, row.done + (min(self.chunk, max_tokens) if max_tokens else self.chunk))
            return PrefillProgress(row_id, done=row.done, remaining=total - row.done)

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]:
        """One call for many rows: each row whose whole prompt fits one chunk is prefilled."""
        async with self._call("prefill_group", tuple(row_ids), self.prefill_cost, stoppable=tuple(row_ids)):
            stopped = all(r in self.aborts for r in row_ids)
            out = []
            for row_id in row_ids:
                row = self._row(row_id, "prefill_group")
                total = len(row.spec.prompt) - 1
                if row.joined:
                    self.violations.append(f"prefill_group({row_id}) of a joined row")
                row.aborted = row.aborted or stopped
                if row.done == 0 and 0 < total <= self.chunk and not stopped:
                    row.done = total
                out.append(PrefillProgress(row_id, done=row.done, remaining=total - row.done))
            return out

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]:
        """New rows with the source's prefill done (it must be prefilled and not joined)."""
        async with self._call("fork_rows", (source_id, *(s.row_id for s in specs)), self.open_cost):
            source = self._row(source_id, "fork_rows")
            if source.joined or source.done != len(source.spec.prompt) - 1:
                self.violations.append(f"fork_rows({source_id}) outside the end of its prefill")
            for spec in specs:
                self._check_adapters(spec)
            for spec in specs:
                if spec.row_id in self.rows or spec.prompt != source.spec.prompt:
                    self.violations.append(f"fork_rows({source_id}) into row {spec.row_id}")
                self.rows[spec.row_id] = _FakeRow(spec, done=source.done)
                self.specs[spec.row_id] = spec
            return [RowOpened(s.row_id, cached_tokens=0, to_prefill=0) for s in specs]

    async def join(self, row_id: int) -> TokenOut:
        async with self._call("join", row_id, self.join_cost):
            row = self._row(row_id, "join")
            if row.done != len(row.spec.prompt) - 1 or row.joined or row.aborted:
                self.violations.append(f"join({row_id}) before its prefill completed")
            row.joined = True
            return self._next_token(row)

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]:
        """The rows join together; each one's token 0 comes with the next step."""
        async with self._call("join_group", tuple(row_ids), self.join_cost):
            for row_id in row_ids:
                row = self._row(row_id, "join_group")
                if row.done != len(row.spec.prompt) - 1 or row.joined:
                    self.violations.append(f"join_group({row_id}) before its prefill completed")
                row.joined = True
            return [None] * len(row_ids)

    async def step(self) -> list[TokenOut]:
        batch = tuple(rid for rid, r in self.rows.items() if r.joined)
        async with self._call("step", batch, self.step_cost):
            self._steps += 1
            if not batch:
                self.violations.append("step() with no joined rows")
            if self.fail_step_at is not None and self._steps == self.fail_step_at:
                raise RuntimeError("fake forward failed")
            out = []
            for rid in batch:
                row = self.rows[rid]
                if row.finished:
                    self.violations.append(f"step() over finished row {rid}")
                    continue
                out.append(self._next_token(row))
            return out

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        async with self._call("mount_adapter", adapter_id, self.adapter_cost):
            if adapter_id in self.adapters:
                raise ValueError(f"adapter {adapter_id!r} is already mounted")
            if "bad" in path:
                raise ValueError(f"adapter {adapter_id!r}: shapes do not fit the model")
            report = AdapterReport(adapter_id, path, "lora", 8, 1000 * (len(self.adapters) + 1), f"fp-{adapter_id}")
            self.adapters[adapter_id] = report
            return report

    async def unmount_adapter(self, adapter_id: str) -> bool:
        async with self._call("unmount_adapter", adapter_id, self.adapter_cost):
            if adapter_id not in self.adapters:
                raise ValueError(f"adapter {adapter_id!r} is not mounted")
            del self.adapters[adapter_id]
            if any(adapter_id in row.spec.adapters for row in self.rows.values()):
                self.leaving_adapters.add(adapter_id)
                return False
            return True

    async def embed(self, inputs: list[list[int]], *, dimensions: int | None = None) -> list[list[float]]:
        """`fake_embedding` of each input, one `embed` call per `plan_jobs` group, each taking
        `embed_cost` and queued behind a running call (as the real worker's job queue does)."""
        pooling = self.info.embedding
        if pooling is None:
            raise NotAnEmbeddingModel("this model is not an embedding model")
        vectors: list[list[float]] = [[] for _ in inputs]
        for group in plan_jobs([len(t) for t in inputs]):
            while self._busy:
                await trio.sleep(self.embed_cost or 0.001)
            async with self._call("embed", tuple(len(inputs[i]) for i in group), self.embed_cost):
                for i in group:
                    vectors[i] = fake_embedding(inputs[i], pooling.dimensions, dimensions, pooling.normalize)
        return vectors

    def _check_adapters(self, spec: RowSpec) -> None:
        missing = [a for a in spec.adapters if a not in self.adapters]
        if missing:
            raise AdapterNotMounted(f"adapter {missing[0]!r} is not mounted")

    def abort(self, row_id: int) -> None:
        """Not a call (it may come while one runs): a running prefill whose rows are now all
        aborted ends at once, keeping nothing; the row may then only close."""
        self.aborts[row_id] = trio.current_time()
        if self._prefilling is not None and all(r in self.aborts for r in self._prefilling[0]):
            self._prefilling[1].set()

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        async with self._call("close_row", row_id, self.close_cost):
            if self.rows.pop(row_id, None) is None:
                self.violations.append(f"close_row({row_id}) of an unknown row")
            used = {a for row in self.rows.values() for a in row.spec.adapters}
            self.leaving_adapters &= used
            self.closed[row_id] = (trio.current_time(), reusable)

    # -- helpers

    def expected(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        """The solo output of a prompt: what any schedule must deliver."""
        spec = RowSpec(0, prompt, SamplingParams(), max_tokens)
        eos = self.eos_at(spec)
        out = []
        for pos in range(max_tokens):
            if eos is not None and pos == eos:
                out.append(EOS)
                break
            out.append(self.token_fn(prompt, pos))
        return out

    def batches(self) -> list[tuple[float, tuple[int, ...]]]:
        return [(t, ids) for t, call, ids in self.calls if call == "step"]

    def _next_token(self, row: _FakeRow) -> TokenOut:
        # A resumed row's prompt ends with the tokens it generated before: the same functions of
        # the original prompt and position give what it would have produced.
        resumed = row.spec.resumed
        base = row.spec.prompt[: len(row.spec.prompt) - resumed]
        original = attrs.evolve(row.spec, prompt=base, max_tokens=row.spec.max_tokens + resumed, resumed=0)
        pos = resumed + row.generated
        row.generated += 1
        drafted, accepted = self.spec_at(original, pos)
        if self.eos_at(original) == pos:
            row.finished = True
            return TokenOut(row.spec.row_id, EOS, "stop", drafted=drafted, accepted=accepted)
        token = self.token_fn(base, pos)
        finish = None
        if row.generated >= row.spec.max_tokens:
            row.finished = True
            finish = "length"
        return TokenOut(row.spec.row_id, token, finish, drafted=drafted, accepted=accepted)

    def _row(self, row_id: int, call: str) -> _FakeRow:
        row = self.rows.get(row_id)
        if row is None:
            self.violations.append(f"{call}({row_id}) of an unknown row")
            raise KeyError(row_id)
        return row

    @asynccontextmanager
    async def _call(self, name: str, arg: Any, cost: float, stoppable: tuple[int, ...] = ()) -> AsyncIterator[None]:
        """`stoppable`: the rows of a prefill, which ends early once `abort` has reached all."""
        if self._busy:
            self.violations.append(f"{name} while another call runs")
        self._busy = True
        self.calls.append((trio.current_time(), name, arg))
        try:
            if stoppable:
                self._prefilling = (stoppable, stop := trio.Event())
                if all(r in self.aborts for r in stoppable):
                    stop.set()
                with trio.move_on_after(cost):
                    await stop.wait()
                self._prefilling = None
            else:
                await trio.sleep(cost)
            yield
        finally:
            self._busy = False
            self._prefilling = None


def fake_embedding(tokens: list[int], size: int, dimensions: int | None, normalize: bool) -> list[float]:
    """A vector that depends on the input's tokens only (never on its batch)."""
    key = sum((i + 1) * t for i, t in enumerate(tokens))
    vector = [float((key * (k + 3) + 7 * k) % 97 - 48) for k in range(size)][: dimensions or size]
    if normalize:
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    return vector


# --- a tokenizer double whose text is easy to read in assertions -----------------------------


def token_text(token_id: int) -> str:
    return f"t{token_id} "


class FakeDetokenizer:
    def __init__(self) -> None:
        self._segment = ""

    def add_token(self, token_id: int) -> None:
        self._segment = token_text(token_id)

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment

    def finalize(self) -> None:
        pass


class ScriptDetokenizer:
    """Token id i is the text `script[i - 1]` (tests that script a reply piece by piece)."""

    def __init__(self, script: Sequence[str]) -> None:
        self._script = script
        self._segment = ""

    def add_token(self, token_id: int) -> None:
        self._segment += self._script[token_id - 1]

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment

    def finalize(self) -> None:
        pass


# `<role>content` per message, `<assistant>` to generate; a message "RAISE" is refused.
FAKE_TEMPLATE = ChatTemplate(
    "{% for m in messages %}{% if m.content == 'RAISE' %}{{ raise_exception('template refused the messages') }}"
    "{% endif %}<{{ m.role }}>{{ m.content or '' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


class FakeTokenizer:
    """A `ChatTokenizer`: characters as ids (1..250), the `<role>content` template, no known
    vocabulary bound (ids the fake worker makes go past the characters')."""

    eos_token_ids = frozenset({EOS})
    has_thinking = False
    has_chat_template = True
    vocab_size: int | None = None

    def id_to_token(self, token_id: int) -> str:
        return token_text(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 250 for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(token_text(i) for i in ids)

    def chat_template(self, *, tools: Sequence[Any] | None = None) -> ChatTemplate:
        return FAKE_TEMPLATE

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        return FAKE_TEMPLATE.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def detokenizer(self) -> TextStream:
        return FakeDetokenizer()


# --- driving a scheduler directly ------------------------------------------------------------


@attrs.define
class RowLog:
    """Everything one row's channel delivered, with virtual timestamps."""

    events: list[tuple[float, Any]] = attrs.Factory(list)
    ended_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return [e.token for _, e in self.events if isinstance(e, TokenOut)]

    @property
    def token_times(self) -> list[float]:
        return [t for t, e in self.events if isinstance(e, TokenOut)]


class SchedulerHarness:
    def __init__(self, scheduler: Scheduler, inbox: trio.MemorySendChannel, nursery: trio.Nursery) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self._nursery = nursery
        self.receivers: dict[int, trio.MemoryReceiveChannel] = {}

    def submit(
        self,
        row_id: int,
        prompt: tuple[int, ...],
        max_tokens: int = 4,
        lane: Lane = "batched",
        *,
        collect: bool = True,
        observer: RequestObserver = NULL_OBSERVER,
    ) -> RowLog:
        send, recv = trio.open_memory_channel(math.inf)
        spec = RowSpec(row_id, prompt, SamplingParams(seed=row_id), max_tokens)
        self.inbox.send_nowait(Enqueue(spec=spec, lane=lane, rows=send, observer=observer))
        self.receivers[row_id] = recv
        log = RowLog()
        if collect:
            self._nursery.start_soon(self._collect, recv, log)
        return log

    async def _collect(self, recv: trio.MemoryReceiveChannel, log: RowLog) -> None:
        try:
            async for event in recv:
                log.events.append((trio.current_time(), event))
        except trio.ClosedResourceError:
            pass  # the test closed our end: an abort
        log.ended_at = trio.current_time()


@asynccontextmanager
async def scheduler_harness(
    worker: FakeWorker,
    *,
    capacity: int = 8,
    group_prefill_tokens: int = 0,
    decoding_prefill_chunk: int = 0,
    arrivals: Arrivals | None = None,
    arrival_window: float = 0.0,
    kv_budget: KvBudget | None = None,
    preempts: bool = True,
) -> AsyncIterator[SchedulerHarness]:
    inbox_send, inbox_recv = trio.open_memory_channel(math.inf)
    scheduler = Scheduler(
        worker,
        capacity=capacity,
        inbox=inbox_recv,
        group_prefill_tokens=group_prefill_tokens,
        decoding_prefill_chunk=decoding_prefill_chunk,
        arrival_window=arrival_window,
        pending_arrivals=(lambda: arrivals.pending) if arrivals else (lambda: 0),
        kv_budget=kv_budget,
        preempts=preempts,
    )
    if arrivals is not None:
        arrivals.on_settled = scheduler.nudge
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        yield SchedulerHarness(scheduler, inbox_send, nursery)
        nursery.cancel_scope.cancel()


if TYPE_CHECKING:  # the doubles meet the protocols of what they stand in for (mypy checks this file)
    from actors.root import RunnableWorker

    _worker: RunnableWorker = FakeWorker()
    _tokenizer: ChatTokenizer = FakeTokenizer()
    _stream: TextStream = FakeDetokenizer()
    _scripted: TextStream = ScriptDetokenizer(())
