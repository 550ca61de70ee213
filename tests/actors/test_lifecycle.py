"""The server's lifecycle as clients see it, on virtual time (the fake GPU worker, the root's
`run_server`, the real app through its test client or raw ASGI):

* while the model loads the port is already bound and every request is 503 + Retry-After in its
  API's envelope, /health 503 `{"status": "loading"}`;
* at the first signal, requests still queued are refused with 503 + Retry-After in their
  protocol's error shape (never 200 with an empty completion), the generating one finishes, and
  /health is 503 for the whole grace period, the listener closing only when the last generating
  request has ended;
* start-up failures (a busy port, a model that does not load) are `StartupFailed` with a one-line
  message and a usage exit code; the port is bound before the model loads.
"""

from __future__ import annotations

import errno
import json
from functools import partial

import pytest
import trio

from actors.options import options as serve_options
from actors.root import run_server
from actors.shutdown import Shutdown
from actors.startup import USAGE_EXIT, startup_failure
from model.load.errors import ModelLoadError
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.shutdown import names, order_is

MODEL = "fake-model"
OPENAI_BODY = {"model": MODEL, "prompt": "a", "max_tokens": 3}
ANTHROPIC_BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "a"}]}
RESPONSES_BODY = {"model": MODEL, "input": "a", "max_output_tokens": 3}


async def asgi_request(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request straight through an ASGI app: (status, headers, body)."""
    payload = json.dumps(body).encode() if body is not None else b""
    sent: list[dict] = []
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8080),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def lifecycle_http(clients, *, note, bound: list | None = None):
    """A serve_http double that behaves like hypercorn: the trigger is awaited once bound; each
    client gets the app as served (the LifecycleApp) and runs from the start."""

    async def serve_http(app, shutdown_trigger):
        if bound is not None:
            bound.append(trio.current_time())
        async with trio.open_nursery() as connections:
            for run_client in clients:
                connections.start_soon(run_client, app)
            await shutdown_trigger()
            note("listeners closed")

    return serve_http


async def run(worker, clients, *, signals_at, timeout=30.0, batch=1, bound=None):
    events: list[tuple[float, object]] = []

    def note(what):
        events.append((trio.current_time(), what))

    shutdown = Shutdown()
    config = serve_options(shutdown_timeout=timeout, batch=batch, group_prefill="off")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                run_server,
                worker,
                options=config,
                make_tokenizer=lambda info: FakeTokenizer(),
                serve_http=lifecycle_http([partial(c, note) for c in clients], note=note, bound=bound),
                shutdown=shutdown,
                trace=note,
            )
        )
        for at in signals_at:
            await trio.sleep_until(at)
            note("signal")
            shutdown.request()
    note("returned")
    return events


def seen(events, name):
    return [what for _, what in events if isinstance(what, tuple) and what[0] == name]


# -- loading


class SlowLoad(FakeWorker):
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        await trio.sleep(10)  # the model loads from t=0 to t=10
        await super().run(task_status=task_status)


async def test_requests_during_model_load_get_503_loading_in_their_api_shape(autojump_clock):
    async def during_load(note, app):
        await trio.sleep(1)
        for method, path, body in [
            ("GET", "/health", None),
            ("POST", "/v1/completions", OPENAI_BODY),
            ("POST", "/v1/messages", ANTHROPIC_BODY),
            ("POST", "/v1/responses", RESPONSES_BODY),
        ]:
            status, headers, raw = await asgi_request(app, method, path, body)
            note(("loading", path, status, headers.get("retry-after"), json.loads(raw)))
        await app.served.wait()
        status, _, raw = await asgi_request(app.app, "GET", "/health")
        note(("loaded", status, raw))

    events = await run(SlowLoad(), [during_load], signals_at=[20])
    answers = {path: (status, retry, body) for _, path, status, retry, body in seen(events, "loading")}
    assert answers["/health"] == (503, "5", {"status": "loading"})
    assert answers["/v1/completions"][:2] == (503, "5")
    assert answers["/v1/completions"][2]["error"]["code"] == "model_loading"
    assert answers["/v1/messages"][:2] == (503, "5")
    assert answers["/v1/messages"][2]["type"] == "error"
    assert answers["/v1/messages"][2]["error"]["type"] == "overloaded_error"
    assert answers["/v1/responses"][:2] == (503, "5")
    assert answers["/v1/responses"][2]["error"]["type"] == "server_error"
    assert seen(events, "loaded") == [("loaded", 200, b'{"status": "ok"}')]
    assert order_is(events, "listening", "loading", "serving", "loaded")


async def test_the_port_is_bound_before_the_model_loads(autojump_clock):
    bound: list[float] = []
    events = await run(SlowLoad(), [], signals_at=[20], bound=bound)
    times = {name: t for (t, _), name in zip(events, names(events))}
    assert bound == [0] and times["listening"] == 0 and times["serving"] == 10


# -- shutdown with queued requests


def generating(note, app):
    """A stream that starts at once and runs 5 tokens: join 1 s + 1 s per step, ends at t=5."""

    async def client():
        await app.served.wait()
        status, _, raw = await asgi_request(
            app.app, "POST", "/v1/completions", {**OPENAI_BODY, "max_tokens": 5, "stream": True}
        )
        frames = [f.removeprefix("data: ") for f in raw.decode().split("\n\n") if f]
        final = json.loads(frames[-2])
        note(("generated", status, frames[-1], final["choices"][0]["finish_reason"]))

    return client()


def queued(path, body):
    async def client(note, app):
        await app.served.wait()
        await trio.sleep(0.5)  # behind the generating row (--batch 1): queued
        status, headers, raw = await asgi_request(app.app, "POST", path, body)
        note(("queued answer", path, body.get("stream", False), status, headers.get("retry-after"), json.loads(raw)))

    return client


async def health_during_grace(note, app):
    await app.served.wait()
    await trio.sleep(3)  # after the signal, while the generating stream still runs
    status, headers, raw = await asgi_request(app.app, "GET", "/health")
    note(("health", status, headers.get("retry-after"), json.loads(raw)))
    status, headers, raw = await asgi_request(app.app, "POST", "/v1/messages", ANTHROPIC_BODY)
    note(("new request", status, headers.get("retry-after"), json.loads(raw)))


async def test_queued_requests_get_503_with_retry_after_at_the_signal(autojump_clock):
    clients = [
        generating,
        queued("/v1/completions", OPENAI_BODY),
        queued("/v1/completions", {**OPENAI_BODY, "stream": True}),
        queued("/v1/messages", {**ANTHROPIC_BODY, "stream": True}),
        queued("/v1/responses", RESPONSES_BODY),
        queued("/v1/responses", {**RESPONSES_BODY, "stream": True}),
        health_during_grace,
    ]
    worker = FakeWorker()
    events = await run(worker, clients, signals_at=[2])
    times = {name: t for (t, _), name in zip(events, names(events))}

    # Every queued request: 503 + Retry-After in its protocol's envelope, answered at the signal.
    answers = seen(events, "queued answer")
    assert len(answers) == 5
    for _, path, stream, status, retry, body in answers:
        assert (status, retry) == (503, "1"), (path, stream, status)
        if path == "/v1/messages":
            assert body == {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "server is shutting down"},
            }
        else:
            assert body["error"]["type"] == "server_error" and body["error"]["code"] == "shutting_down", body
    assert all(t == 2 for t, what in events if isinstance(what, tuple) and what[0] == "queued answer")
    # Their rows never ran: only the generating row was ever opened.
    assert list(worker.specs) == [1]

    # The generating stream finished in full; /health and a new request were 503 meanwhile.
    assert seen(events, "generated") == [("generated", 200, "[DONE]", "length")]
    assert times["generated"] == 5
    _, status, retry, body = seen(events, "health")[0]
    assert (status, retry, body) == (503, "1", {"status": "unavailable", "reason": "shutting down"})
    _, status, retry, body = seen(events, "new request")[0]
    assert (status, retry, body["error"]["type"]) == (503, "1", "overloaded_error")
    # The listener stayed open through the grace period: it closed once the stream had ended.
    assert order_is(events, "signal", "admission closed", "health", "listeners closing", "http done")
    assert times["listeners closing"] == times["generated"] == 5


async def test_the_listener_closes_at_the_drain_deadline_when_generation_runs_on(autojump_clock):
    async def long_stream(note, app):
        await app.served.wait()
        await asgi_request(app.app, "POST", "/v1/completions", {**OPENAI_BODY, "max_tokens": 100, "stream": True})
        note(("generated",))

    events = await run(FakeWorker(), [long_stream], signals_at=[2], timeout=3)
    times = {name: t for (t, _), name in zip(events, names(events))}
    assert times["listeners closing"] == 5  # signal + --shutdown-timeout


# -- start-up failures


async def test_a_busy_port_is_a_usage_failure_before_any_load(autojump_clock):
    class Watched(FakeWorker):
        started = False

        async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
            Watched.started = True
            await super().run(task_status=task_status)

    async def busy(app, shutdown_trigger):
        raise OSError(errno.EADDRINUSE, "Address already in use")

    with pytest.raises(BaseException) as caught:
        await run_server(
            Watched(),
            options=serve_options(port=8123),
            make_tokenizer=lambda info: FakeTokenizer(),
            serve_http=busy,
            shutdown=Shutdown(),
        )
    failure = startup_failure(caught.value)
    assert failure is not None and failure.exit_code == USAGE_EXIT
    assert failure.message == "cannot listen on 127.0.0.1:8123: Address already in use"
    assert not Watched.started  # the bind comes first


async def test_a_model_that_does_not_load_is_a_one_line_usage_failure(autojump_clock):
    class Broken(FakeWorker):
        async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
            raise ModelLoadError("/models/x: unsupported model_type 'nonsense'")

    with pytest.raises(BaseException) as caught:
        await run(Broken(), [], signals_at=[])
    failure = startup_failure(caught.value)
    assert failure is not None and failure.exit_code == USAGE_EXIT
    assert "unsupported model_type 'nonsense'" in failure.message and "\n" not in failure.message


async def test_a_crash_that_is_not_a_start_up_failure_is_not_disguised_as_one():
    assert startup_failure(ExceptionGroup("x", [RuntimeError("boom")])) is None
