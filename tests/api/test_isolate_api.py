"""The HTTP surface over an isolated engine (`--isolate`) on MockClock time: the app and actors in
this process, the engine's host serving a fake worker over a memory stream (tests/helpers/isolate.py).

A killed engine ends each protocol's stream with that protocol's error event at once; /health is
503 while it restarts and ok after; an engine that keeps dying leaves the model failed: /health
"degraded", /v1/models says so, and a request gets a 503."""

from __future__ import annotations

import json

import trio

from actors.isolate.worker import RestartPolicy
from tests.fakes import FakeTokenizer, FakeWorker, token_text
from tests.helpers.fake_server import server
from tests.helpers.http import post_stream
from tests.helpers.isolate import isolated

STREAMS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "stream": True, "model": "fake-model"},
    "/v1/responses": {"input": "hi", "stream": True},
}


def _fake() -> FakeWorker:
    return FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)


def _last_events(body: bytes) -> list[str]:
    frames = [frame for frame in body.decode().split("\n\n") if frame.strip()]
    return frames[-2:]


async def test_a_killed_engine_ends_every_protocols_stream_with_its_error_event(autojump_clock):
    async with trio.open_nursery() as engines_nursery:
        worker, engines = isolated(engines_nursery, _fake, policy=RestartPolicy(backoff_s=5.0))
        async with server(worker, isolate=True) as (client, _, _):
            bodies: dict[str, bytes] = {}
            ended: dict[str, float] = {}

            async def stream(path: str) -> None:
                bodies[path] = await post_stream(client, path, {**STREAMS[path], "max_tokens": 500})
                ended[path] = trio.current_time()

            async with trio.open_nursery() as nursery:
                for path in STREAMS:
                    nursery.start_soon(stream, path)
                await trio.sleep(3)
                killed = trio.current_time()
                engines.last.kill()
                await trio.sleep(0.5)
                health = await client.get("/health")  # restarting: the backoff is 5 s
                assert health.status_code == 503
            assert all(at - killed < 0.5 for at in ended.values()), ended

            error, done = _last_events(bodies["/v1/chat/completions"])
            assert done == "data: [DONE]"
            assert json.loads(error.removeprefix("data: "))["error"]["type"] == "server_error"
            anthropic = _last_events(bodies["/v1/messages"])[-1]
            assert anthropic.startswith("event: error") and "engine process died" in anthropic
            responses = _last_events(bodies["/v1/responses"])[-1]
            assert responses.startswith("event: response.failed") and "engine process died" in responses

            await trio.sleep(10)  # the new engine serves
            assert (await client.get("/health")).status_code == 200
            again = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert again.status_code == 200
            expected = FakeWorker().expected(tuple(FakeTokenizer().encode("hi")), 3)
            assert (await again.get_json())["choices"][0]["text"] == "".join(token_text(t) for t in expected)
        engines_nursery.cancel_scope.cancel()


async def test_an_engine_that_keeps_dying_marks_the_model_failed(autojump_clock):
    async with trio.open_nursery() as engines_nursery:
        policy = RestartPolicy(max_restarts=1, backoff_s=1.0)
        worker, engines = isolated(engines_nursery, _fake, policy=policy)
        async with server(worker, isolate=True) as (client, _, _):
            for _ in range(2):
                engines.last.kill()
                await trio.sleep(3)
            assert worker.state == "failed"
            health = await client.get("/health")
            assert health.status_code == 503
            body = await health.get_json()
            assert body["status"] == "degraded" and "gave up after 1 restarts" in body["failed"]["fake-model"]
            card = (await (await client.get("/v1/models")).get_json())["data"][0]
            assert card["status"] == "failed" and "killed by SIGKILL" in card["error"]
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert refused.status_code == 503
            assert "failed" in (await refused.get_json())["error"]["message"]
        engines_nursery.cancel_scope.cancel()


async def test_a_stream_to_a_failed_model_is_a_503_not_an_sse_error(autojump_clock):
    """A model already failed for good is known before the answer starts: each protocol's
    stream gets the 503 a whole answer gets (its error envelope), not a 200 with an error event."""
    async with trio.open_nursery() as engines_nursery:
        worker, engines = isolated(engines_nursery, _fake, policy=RestartPolicy(max_restarts=0))
        async with server(worker, isolate=True) as (client, _, _):
            engines.last.kill()
            await trio.sleep(3)
            assert worker.state == "failed"
            for path, body in STREAMS.items():
                refused = await client.post(path, json={**body, "max_tokens": 3})
                assert refused.status_code == 503, (path, await refused.get_data())
                assert refused.content_type.startswith("application/json"), path
                assert "failed" in json.dumps(await refused.get_json()), path
        engines_nursery.cancel_scope.cancel()
