"""OpenTelemetry request traces: the span tree of a completion, W3C trace-context in and out, the
abort phase, the flag, and tracing off importing nothing (api/observability/tracing.py and
trace_spans.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from actors.options import options as serve_options
from actors.options import parse_options
from actors.root import start_actors
from api.app import create_app
from api.observability.tracing import ENDPOINT_VARIABLE, install_tracing, trace_endpoint
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.options import parsed

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]  # 19 prompt tokens: 3 chunks of 8 (the last token joins)
PHASES = ["parse", "template", "queue", "prefill", "decode", "stream close"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@asynccontextmanager
async def traced(worker: FakeWorker | None = None, **config):
    worker = worker or FakeWorker(chunk=8, prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    exporter = InMemorySpanExporter()
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        app = create_app(handles)
        assert install_tracing(app, handles, exporter=exporter) is not None
        yield app.test_client(), exporter, handles
        nursery.cancel_scope.cancel()


def tree(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    """The one request span and its descendants by name."""
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.kind == SpanKind.SERVER]
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        if span is not root:
            assert span.context.trace_id == root.context.trace_id
            by_name.setdefault(span.name, []).append(span)
    return root, by_name


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


def seconds(ns: int) -> float:
    return ns / 1e9


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_is_one_span_tree(autojump_clock, stream):
    async with traced() as (client, exporter, _):
        body = {"messages": MESSAGES, "max_tokens": 3, "stream": stream}
        response = await client.post(CHAT, json=body, headers={"X-Request-Id": "abc-123"})
        assert response.status_code == 200
        await response.get_data()
    root, spans = tree(exporter)
    assert root.name == f"POST {CHAT}" and root.parent is None
    prompt_tokens = len(FakeTokenizer().encode_chat(MESSAGES))
    attributes = dict(root.attributes or {})
    assert attributes == {
        "http.request.method": "POST",
        "url.path": CHAT,
        "http.route": CHAT,
        "http.response.status_code": 200,
        "mlx_trio.request.id": "abc-123",  # the id the log line carries
        "gen_ai.request.model": "fake-model",
        "mlx_trio.lane": "batched",
        "gen_ai.usage.input_tokens": prompt_tokens,
        "mlx_trio.usage.cached_tokens": 0,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.response.finish_reasons": ("length",),
    }
    assert root.status.status_code == StatusCode.UNSET
    # Every phase once, a child of the request span, in order, each starting where the last ended.
    assert sorted(spans) == sorted([*PHASES, "prefill chunk"])
    phases = [spans[name][0] for name in PHASES]
    assert all(child_of(span, root) and len(spans[span.name]) == 1 for span in phases)
    assert phases[0].start_time == root.start_time and phases[-1].end_time == root.end_time
    for before, after in zip(phases, phases[1:]):
        assert before.end_time == after.start_time, (before.name, after.name)
    prefill, decode = spans["prefill"][0], spans["decode"][0]
    # 18 tokens to prefill in chunks of 8 (0.1 s each), then the join (0.1 s) gives token 0.
    chunks = spans["prefill chunk"]
    assert [c.attributes["mlx_trio.prefill.done"] for c in chunks] == [8, 16, 18]
    assert [c.attributes["mlx_trio.prefill.remaining"] for c in chunks] == [10, 2, 0]
    assert all(child_of(c, prefill) for c in chunks)
    assert chunks[0].start_time == prefill.start_time
    assert seconds(chunks[-1].end_time - chunks[0].start_time) == pytest.approx(0.3)
    assert seconds(prefill.end_time - prefill.start_time) == pytest.approx(0.4)
    assert seconds(decode.end_time - decode.start_time) == pytest.approx(0.2)  # tokens 1 and 2: two steps
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3
    assert spans["queue"][0].events[0].name == "admitted"
    assert spans["stream close"][0].attributes["gen_ai.response.finish_reasons"] == ("length",)


async def test_the_client_traceparent_is_the_parent_and_the_response_names_the_request_span(autojump_clock):
    async with traced() as (client, exporter, _):
        incoming = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
        response = await client.post(
            CHAT, json={"messages": MESSAGES, "max_tokens": 2}, headers={"traceparent": incoming}
        )
        outgoing = response.headers["traceparent"]
        untraced = await client.get("/v1/models")  # no traceparent in: a new trace, still named
    request = next(s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER and s.name.startswith("POST"))
    assert f"{request.context.trace_id:032x}" == TRACE_ID
    assert request.parent is not None and f"{request.parent.span_id:016x}" == PARENT_SPAN_ID
    assert request.parent.is_remote
    version, trace_id, span_id, flags = outgoing.split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id == f"{request.context.span_id:016x}"
    models_span = next(s for s in exporter.get_finished_spans() if s.name == "GET /v1/models")
    assert models_span.parent is None and f"{models_span.context.trace_id:032x}" != TRACE_ID
    assert untraced.headers["traceparent"].split("-")[2] == f"{models_span.context.span_id:016x}"
    assert not [s for s in exporter.get_finished_spans() if child_of(s, models_span)]  # no generation: no phases


async def test_an_aborted_request_records_the_phase_it_cut(autojump_clock):
    async with traced(FakeWorker(step_cost=1.0)) as (client, exporter, _):
        async with client.request(CHAT, method="POST", headers={"Content-Type": "application/json"}) as conn:
            await conn.send(json.dumps({"messages": MESSAGES, "max_tokens": 50, "stream": True}).encode())
            await conn.send_complete()
            for _ in range(3):
                await conn.receive()
            await conn.disconnect()
            conn._client_send.close()  # quart-trio's test client hangs on a disconnect unless its send side is closed
        await trio.sleep(2)
    root, spans = tree(exporter)
    assert root.attributes["mlx_trio.abort.phase"] == "decode"
    assert root.attributes["mlx_trio.abort.cause"] == "client"
    assert root.attributes["mlx_trio.client_abort"] is True
    assert root.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    [decode] = spans["decode"]
    assert decode.attributes["mlx_trio.abort.phase"] == "decode"
    assert 0 < decode.attributes["gen_ai.usage.output_tokens"] < 50
    assert "mlx_trio.abort.phase" not in spans["prefill"][0].attributes


async def test_a_request_aborted_in_prefill_ends_its_prefill_span_at_the_abort(autojump_clock):
    async with traced(FakeWorker(chunk=8, prefill_cost=5.0)) as (client, exporter, _):
        with trio.move_on_after(7):  # in the second chunk
            await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5})
        await trio.sleep(10)
    root, spans = tree(exporter)
    assert root.attributes["mlx_trio.abort.phase"] == "prefill"
    [prefill] = spans["prefill"]
    assert prefill.attributes["mlx_trio.abort.phase"] == "prefill"
    assert seconds(prefill.end_time - root.start_time) == pytest.approx(7.0)
    assert "decode" not in spans


async def test_a_refused_request_ends_at_the_queue_and_a_5xx_is_an_error(autojump_clock):
    async with traced() as (client, exporter, handles):
        handles.admission.close(cutoff_after=1)  # shutting down: admission refuses with 503
        response = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
        assert response.status_code == 503
    root, spans = tree(exporter)
    assert root.attributes["http.response.status_code"] == 503
    assert root.status.status_code == StatusCode.ERROR
    assert "mlx_trio.rejected" in root.attributes
    [queue] = spans["queue"]
    assert queue.attributes["mlx_trio.rejected"] == root.attributes["mlx_trio.rejected"]
    assert "prefill" not in spans and "decode" not in spans
    assert spans["stream close"][0].start_time == queue.end_time


def test_the_flag_and_the_standard_variable_name_the_collector(monkeypatch):
    monkeypatch.delenv(ENDPOINT_VARIABLE, raising=False)
    assert trace_endpoint(None) is None
    assert parsed([]).otlp_endpoint is None
    config = parsed(["--otlp-endpoint", "http://collector:4318"])
    assert config.otlp_endpoint == "http://collector:4318"
    assert trace_endpoint(config.otlp_endpoint) == "http://collector:4318/v1/traces"
    assert trace_endpoint("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    monkeypatch.setenv(ENDPOINT_VARIABLE, "https://otel.example:4318/")
    assert trace_endpoint(None) == "https://otel.example:4318/v1/traces"
    assert trace_endpoint("http://flag:4318") == "http://flag:4318/v1/traces"  # the flag wins


def test_a_bad_url_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--otlp-endpoint", "collector:4318"])
    assert exit_.value.code == 2
    assert "--otlp-endpoint: must be an http:// or https:// URL" in capsys.readouterr().err


def test_the_flag_without_the_packages_stops_start_up_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("model.options.values.otel_installed", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--otlp-endpoint", "http://localhost:4318"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'mlx-trio-server[otel]'" in err


_UNTRACED = textwrap.dedent(
    """
    import sys
    import trio
    from actors.options import options as serve_options
    from actors.root import start_actors
    from api.app import create_app
    from tests.fakes import FakeTokenizer, FakeWorker

    async def main():
        async with trio.open_nursery() as nursery:
            handles = await start_actors(
                nursery, FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1), options=serve_options(),
                make_tokenizer=lambda info: FakeTokenizer(),
            )
            client = create_app(handles).test_client()
            for stream in (False, True):
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.status_code
                assert "traceparent" not in response.headers
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
    """
)


def test_tracing_off_imports_no_opentelemetry(monkeypatch):
    monkeypatch.delenv(ENDPOINT_VARIABLE, raising=False)
    import trio.testing  # noqa: F401  (the script's MockClock)

    done = subprocess.run(
        [sys.executable, "-c", "import trio.testing\n" + _UNTRACED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
