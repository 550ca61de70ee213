"""Model names over the real actors and a FakeWorker (MockClock): which `model` values each
generation route accepts, the 404 `model_not_found` in each API's envelope, /v1/models and
/v1/models/{id}; plus the two protocol details that ride on the same routes: Anthropic usage
(message_start carries message_delta's cache split) and the Responses `response.incomplete`."""

from __future__ import annotations

import json

import attrs
import pydantic
import pytest

from model.engine.rows import RowOpened, RowSpec
from tests.fakes import FakeWorker
from tests.helpers.fake_server import server
from tests.helpers.http import post_stream

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
from openai.types import Model as SdkModel  # noqa: E402
from openai.types.responses import Response as SdkResponse  # noqa: E402
from openai.types.responses import ResponseStreamEvent  # noqa: E402

CHAT, TEXT, MESSAGES, COUNT, RESPONSES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
BODIES = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    TEXT: {"prompt": "hi", "max_tokens": 2},
    MESSAGES: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COUNT: {"messages": [{"role": "user", "content": "hi"}]},
    RESPONSES: {"input": "hi", "max_output_tokens": 2},
}
ANTHROPIC_ERROR = pydantic.TypeAdapter(anthropic.types.ErrorResponse)
RESPONSE_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


async def post(client, path: str, **fields):
    return await client.post(path, json={**BODIES[path], **fields})


async def test_an_unknown_model_is_a_404_in_each_apis_envelope(autojump_clock):
    async with server() as (client, _, worker):
        for path in (CHAT, TEXT, RESPONSES):
            response = await post(client, path, model="gpt-4o")
            assert response.status_code == 404, path
            assert await response.get_json() == {
                "error": {
                    "message": "The model `gpt-4o` does not exist. This server serves `fake-model`.",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }, path
        for path in (MESSAGES, COUNT):
            response = await post(client, path, model="claude-x")
            assert response.status_code == 404, path
            error = await response.get_json()
            ANTHROPIC_ERROR.validate_python(error)
            assert error == {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": "The model `claude-x` does not exist. This server serves `fake-model`.",
                },
            }
        for path in BODIES:  # streaming changes nothing: the answer comes before any byte
            assert (await post(client, path, model="nope", stream=True)).status_code == 404, path
        long = await post(client, CHAT, model="x" * 5000)
        assert len((await long.get_json())["error"]["message"]) < 400  # the echo is capped
        for path in BODIES:
            response = await post(client, path, model=7)
            assert response.status_code == 400, path
    assert worker.specs == {}  # nothing reached the worker


async def test_accepted_names(autojump_clock, tmp_path):
    model_dir = tmp_path / "weights" / "tiny"
    model_dir.mkdir(parents=True)
    async with server(model=str(model_dir) + "/", served_model_name=("public", "alias")) as (client, _, worker):
        accepted = [None, "", "public", "alias", "default_model", str(model_dir), str(model_dir) + "/"]
        for name in accepted:
            fields = {} if name is None else {"model": name}
            for path in BODIES:
                response = await post(client, path, **fields)
                assert response.status_code == 200, (path, name, await response.get_data())
        for name in ("fake-model", "tiny", "PUBLIC", "public2", str(tmp_path)):
            assert (await post(client, CHAT, model=name)).status_code == 404, name


async def test_the_404_names_every_served_name_and_mounted_adapter(autojump_clock):
    async with server(served_model_name=("public", "alias")) as (client, handles, _):
        await handles.adapters.mount("a", "/adapters/a")  # (the fake worker mounts any path)
        for path in (CHAT, MESSAGES, RESPONSES):
            error = (await (await post(client, path, model="gpt-4o")).get_json())["error"]
            assert (
                error["message"]
                == "The model `gpt-4o` does not exist. This server serves `public`, `alias`, `public:a`."
            )
        error = (await (await client.get("/v1/models/nope")).get_json())["error"]
        assert error["message"].endswith("This server serves `public`, `alias`, `public:a`.")
        for i in range(10):
            await handles.adapters.mount(f"b{i}", f"/adapters/b{i}")
        error = (await (await post(client, CHAT, model="gpt-4o")).get_json())["error"]
        assert error["message"].endswith("`public:b3`, `public:b4` and 5 more (GET /v1/models lists them).")


async def test_replies_carry_the_first_served_name(autojump_clock):
    async with server(served_model_name=("public", "alias")) as (client, _, _):
        chat = await (await post(client, CHAT, model="alias")).get_json()
        text = await (await post(client, TEXT)).get_json()
        message = await (await post(client, MESSAGES, model="alias")).get_json()
        response = await (await post(client, RESPONSES, model="alias")).get_json()
        assert [chat["model"], text["model"], message["model"], response["model"]] == ["public"] * 4
        streamed = await post_stream(client, CHAT, {**BODIES[CHAT], "stream": True})
        chunks = [json.loads(f[6:]) for f in streamed.decode().split("\n\n") if f.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {"public"}


async def test_models_list_and_retrieve(autojump_clock):
    async with server(served_model_name=("org/public", "alias")) as (client, _, _):
        listing = await (await client.get("/v1/models")).get_json()
        assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["org/public", "alias"]
        for name in ("org/public", "alias"):
            response = await client.get(f"/v1/models/{name}")
            assert response.status_code == 200
            card = await response.get_json()
            SdkModel.model_validate(card)
            assert card["id"] == name and card["object"] == "model"
            assert card["context_window"] == 4096  # the same card as the listing's
        for name in ("fake-model", "nope", "org"):
            response = await client.get(f"/v1/models/{name}")
            assert response.status_code == 404
            error = (await response.get_json())["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
    async with server() as (client, _, _):  # no flag: the model's own name
        listing = await (await client.get("/v1/models")).get_json()
        assert [m["id"] for m in listing["data"]] == ["fake-model"]
        assert (await (await client.get("/v1/models/fake-model")).get_json())["id"] == "fake-model"


# --- Anthropic usage: message_start, message_delta, the message and count_tokens agree -----------


class CachingWorker(FakeWorker):
    """A FakeWorker whose rows open with all but the last prompt token restored from cache."""

    def __init__(self) -> None:
        super().__init__(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)

    async def open_row(self, spec: RowSpec) -> RowOpened:
        opened = await super().open_row(spec)
        return attrs.evolve(opened, cached_tokens=len(spec.prompt) - 1, to_prefill=0)


def events_of(raw: bytes) -> dict[str, dict]:
    out = {}
    for frame in raw.decode().split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            out.setdefault(lines["event"], json.loads(lines["data"]))
    return out


async def test_anthropic_usage_is_one_split_everywhere(autojump_clock):
    async with server(CachingWorker()) as (client, _, _):
        counted = (await (await post(client, COUNT)).get_json())["input_tokens"]
        events = events_of(await post_stream(client, MESSAGES, {**BODIES[MESSAGES], "stream": True}))
        message = await (await post(client, MESSAGES)).get_json()
    start = events["message_start"]["message"]["usage"]
    delta = events["message_delta"]["usage"]
    split = {"input_tokens": 1, "cache_read_input_tokens": counted - 1}
    assert start == {**split, "output_tokens": 0}
    assert delta == {**split, "output_tokens": 2}
    assert message["usage"] == {**split, "output_tokens": 2}
    assert split["input_tokens"] + split["cache_read_input_tokens"] == counted


# --- Responses: a cut by max_output_tokens ends with response.incomplete -------------------------


def response_events(raw: bytes) -> list[dict]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            out.append(RESPONSE_EVENT.validate_python(json.loads(lines["data"])))
    return out


async def test_responses_cut_by_max_output_tokens_is_incomplete(autojump_clock):
    async with server() as (client, _, _):
        raw = await post_stream(client, RESPONSES, {**BODIES[RESPONSES], "stream": True})
        whole = await (await post(client, RESPONSES)).get_json()
    events = response_events(raw)
    assert events[-1].type == "response.incomplete" and "response.completed" not in [e.type for e in events]
    assert isinstance(events[-1], openai.types.responses.ResponseIncompleteEvent)
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in final.output] == ["incomplete"]
    item_done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in item_done] == ["incomplete"]
    parsed = SdkResponse.model_validate(whole)
    assert parsed.status == "incomplete" and [item.status for item in parsed.output] == ["incomplete"]
