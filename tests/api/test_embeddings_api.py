"""POST /v1/embeddings over the real actors and a FakeWorker: shapes, encodings, dimensions,
usage, job splitting, and every refusal in OpenAI's envelope."""

from __future__ import annotations

import base64
from contextlib import asynccontextmanager

import attrs
import numpy as np
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.load.embedding_config import Pooling
from tests.fakes import FakeTokenizer, FakeWorker, fake_embedding

URL = "/v1/embeddings"
SIZE = 8


def embedding_worker(pooling: Pooling | None = Pooling("lasttoken", True, SIZE)) -> FakeWorker:
    worker = FakeWorker()
    worker.info = attrs.evolve(worker.info, embedding=pooling)
    worker.embed_cost = 0.5
    return worker


@asynccontextmanager
async def server(worker: FakeWorker | None = None, **config):
    worker = worker or embedding_worker()
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client(), handles, worker
        nursery.cancel_scope.cancel()


def expected(tokens: list[int], dimensions: int | None = None, normalize: bool = True) -> list[float]:
    return fake_embedding(tokens, SIZE, dimensions, normalize)


def ids(text: str) -> list[int]:
    return FakeTokenizer().encode(text)


async def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status
    body = await response.get_json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_strings_give_one_vector_each_in_order_with_usage(autojump_clock):
    texts = ["hello there", "a", "the third input is longer than the others"]
    async with server() as (client, _, worker):
        body = await (await client.post(URL, json={"model": "fake-model", "input": texts})).get_json()
    assert body["object"] == "list" and body["model"] == "fake-model"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    for text, item in zip(texts, body["data"]):
        assert item["embedding"] == expected(ids(text))
    total = sum(len(ids(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert [c[1] for c in worker.calls] == ["embed"]  # one job: small inputs batch together


async def test_every_input_shape(autojump_clock):
    async with server() as (client, _, _):
        cases = [
            ("one string", [ids("one string")]),
            (["x", "yy"], [ids("x"), ids("yy")]),
            ([5, 6, 7], [[5, 6, 7]]),
            ([[5, 6, 7], [9]], [[5, 6, 7], [9]]),
        ]
        for given, tokens in cases:
            body = await (await client.post(URL, json={"input": given})).get_json()
            assert [d["embedding"] for d in body["data"]] == [expected(t) for t in tokens], given
            count = sum(map(len, tokens))
            assert body["usage"] == {"prompt_tokens": count, "total_tokens": count}


async def test_base64_is_little_endian_float32_of_the_same_vectors(autojump_clock):
    async with server() as (client, _, _):
        floats = await (await client.post(URL, json={"input": ["ab", "cde"]})).get_json()
        packed = await (await client.post(URL, json={"input": ["ab", "cde"], "encoding_format": "base64"})).get_json()
    for f, b in zip(floats["data"], packed["data"]):
        assert isinstance(b["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.shape == (SIZE,)
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


async def test_dimensions_truncate_and_renormalize(autojump_clock):
    async with server() as (client, _, _):
        body = await (await client.post(URL, json={"input": "abc", "dimensions": 3})).get_json()
        assert body["data"][0]["embedding"] == expected(ids("abc"), 3)
        assert abs(np.linalg.norm(body["data"][0]["embedding"]) - 1.0) < 1e-9
        full = await (await client.post(URL, json={"input": "abc", "dimensions": SIZE})).get_json()
        assert full["data"][0]["embedding"] == expected(ids("abc"))
        for bad in (0, -1, SIZE + 1, "4", True, 2.5):
            error = await error_of(await client.post(URL, json={"input": "abc", "dimensions": bad}))
            assert error["param"] == "dimensions" and error["type"] == "invalid_request_error", bad


async def test_dimensions_need_a_normalizing_model(autojump_clock):
    async with server(embedding_worker(Pooling("mean", False, SIZE))) as (client, _, _):
        body = await (await client.post(URL, json={"input": "abc"})).get_json()
        assert body["data"][0]["embedding"] == expected(ids("abc"), normalize=False)
        error = await error_of(await client.post(URL, json={"input": "abc", "dimensions": 4}))
        assert error["param"] == "dimensions" and "not normalized" in error["message"]


async def test_bad_requests_are_400_in_openai_envelope(autojump_clock):
    async with server() as (client, _, worker):
        cases = [
            ({}, "input is required"),
            ({"input": ""}, "empty strings"),
            ({"input": []}, "must not be empty"),
            ({"input": ["a", ""]}, "empty strings"),
            ({"input": ["a", 1]}, "input must be"),
            ({"input": [[]]}, "input must be"),
            ({"input": [[1], []]}, "input must be"),
            ({"input": [[1, "2"]]}, "input must be"),
            ({"input": [True, False]}, "input must be"),
            ({"input": {"text": "a"}}, "input must be"),
            ({"input": 7}, "input must be"),
            ({"input": [1, -3]}, "outside the vocabulary"),
            ({"input": ["a"] * 2049}, "more than 2048"),
            ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
            ({"input": "a", "user": 5}, "user must be a string"),
            ({"input": "a", "model": 3}, "model must be a string"),
        ]
        for body, message in cases:
            error = await error_of(await client.post(URL, json=body))
            assert message in error["message"], (body, error)
            assert error["type"] == "invalid_request_error"
        error = await error_of(await client.post(URL, data=b"{nope", headers={"Content-Type": "application/json"}))
        assert error["message"] == "invalid JSON body"
        missing = await error_of(await client.post(URL, json={"input": "a", "model": "other"}), 404)
        assert missing["code"] == "model_not_found"
        assert worker.calls == []  # nothing bad reached the worker


async def test_input_longer_than_the_context_is_400(autojump_clock):
    async with server() as (client, handles, worker):
        context = handles.info.context_length
        error = await error_of(await client.post(URL, json={"input": [[1, 2], [7] * (context + 1)]}))
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert f"input 1 is {context + 1} tokens" in error["message"]
        error = await error_of(await client.post(URL, json={"input": "x" * (context * 400)}))
        assert error["code"] == "context_length_exceeded"  # refused by its characters, untokenized
        ok = await client.post(URL, json={"input": [[7] * context]})
        assert ok.status_code == 200
        assert [c[1] for c in worker.calls] == ["embed"]


async def test_generative_model_refuses_embeddings(autojump_clock):
    async with server(embedding_worker(None)) as (client, _, worker):
        error = await error_of(await client.post(URL, json={"input": "hello"}))
        assert error["message"] == "this model is not an embedding model"
        assert error["code"] == "model_not_embedding"
        assert worker.calls == []
        models = await (await client.get("/v1/models")).get_json()
        assert models["data"][0]["embeddings"] is False


async def test_embedding_model_refuses_generation_in_each_envelope(autojump_clock):
    async with server() as (client, _, worker):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for path in ("/v1/chat/completions", "/v1/responses"):
            error = await error_of(await client.post(path, json={**chat, "input": "hi"}))
            assert "embedding model" in error["message"] and error["code"] == "model_not_generative", path
        error = await error_of(await client.post("/v1/completions", json={"prompt": "hi"}))
        assert "embedding model" in error["message"]
        response = await client.post("/v1/messages", json=chat)
        assert response.status_code == 400
        body = await response.get_json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "embedding model" in body["error"]["message"]
        assert worker.calls == []  # no row was ever opened
        card = (await (await client.get("/v1/models")).get_json())["data"][0]
        assert card["embeddings"] is True and card["capabilities"]["embeddings"] is True
        assert card["capabilities"]["chat_completions"] is False


async def test_a_large_request_runs_as_several_jobs(autojump_clock):
    texts = [f"input number {i}" for i in range(100)]
    async with server() as (client, _, worker):
        body = await (await client.post(URL, json={"input": texts})).get_json()
    assert [d["embedding"] for d in body["data"]] == [expected(ids(t)) for t in texts]
    jobs = [arg for _, name, arg in worker.calls if name == "embed"]
    assert len(jobs) == 4 and sum(len(job) for job in jobs) == 100  # 32 inputs per job at most


async def test_concurrent_requests_take_turns_on_the_worker(autojump_clock):
    results: dict[int, list] = {}
    async with server() as (client, _, worker):

        async def one(i: int) -> None:
            body = await (await client.post(URL, json={"input": [f"text {i}"] * 40})).get_json()
            results[i] = [d["embedding"] for d in body["data"]]

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
    assert worker.violations == []  # never two calls at once
    for i in range(3):
        assert results[i] == [expected(ids(f"text {i}"))] * 40


async def test_shutting_down_is_503(autojump_clock):
    async with server() as (client, handles, _):
        handles.admission.close(cutoff_after=10)
        error = await error_of(await client.post(URL, json={"input": "a"}), 503)
        assert error["code"] == "shutting_down"
