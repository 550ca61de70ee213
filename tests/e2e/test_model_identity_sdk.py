"""Model identity through the official SDKs over real HTTP, serving a tiny scripted checkpoint laid
out as a Hugging Face cache snapshot (`models--acme--scripted/snapshots/<hash>`): it is served as
`acme/scripted`, never as its hash; `models.retrieve` works; another name is a NotFoundError in
all three APIs. Also, on the real engine: a prompt-cache hit reports one Anthropic usage split in
message_start, message_delta and the message, summing to count_tokens; and a Responses stream cut
by max_output_tokens ends with the SDK's ResponseIncompleteEvent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.synth import write_scripted_model_dir
from tests.live_http import serve_in_thread

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

NAME = "acme/scripted"
SNAPSHOT = "3f2a9c0d1e4b"
SCRIPT = ("Hello", " from", " a", " scripted", " model", ".")
QUESTION = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repo = tmp_path_factory.mktemp("hub") / "models--acme--scripted"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    snapshot = write_scripted_model_dir(repo / "snapshots" / SNAPSHOT, list(SCRIPT))
    with serve_in_thread(snapshot) as url:
        yield url


def oai(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


def claude(base: str):
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)


def test_served_as_org_slash_name_and_retrievable(base):
    client = oai(base)
    assert [m.id for m in client.models.list()] == [NAME]
    model = client.models.retrieve(NAME)
    assert model.id == NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(SNAPSHOT)  # the hash is no name
    assert missing.value.code == "model_not_found"
    chat = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=3)
    assert chat.model == NAME and chat.choices[0].message.content == "".join(SCRIPT[:3])


def test_another_model_is_not_found_in_every_api(base):
    client = oai(base)
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=3)
    assert chat.value.code == "model_not_found" and chat.value.param == "model"
    with pytest.raises(openai.NotFoundError) as text:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=3)
    assert text.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as responses:
        client.responses.create(model="gpt-4o", input="hi", max_output_tokens=3)
    assert responses.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as messages:
        claude(base).messages.create(model="claude-sonnet-4-5", messages=QUESTION, max_tokens=3)
    assert messages.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        claude(base).messages.count_tokens(model="claude-sonnet-4-5", messages=QUESTION)
    assert claude(base).messages.create(model=NAME, messages=QUESTION, max_tokens=2).model == NAME


def test_anthropic_usage_agrees_on_a_cache_hit(base):
    client = claude(base)
    question = [{"role": "user", "content": "Which usage split does a repeated prompt report?"}]
    counted = client.messages.count_tokens(model=NAME, messages=question).input_tokens
    client.messages.create(model=NAME, messages=question, max_tokens=4)  # fills the prompt cache
    events = list(client.messages.create(model=NAME, messages=question, max_tokens=4, stream=True))
    start = events[0].message.usage
    delta = [e for e in events if e.type == "message_delta"][0].usage
    assert start.cache_read_input_tokens and start.cache_read_input_tokens > 0  # a hit
    assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens, delta.cache_read_input_tokens)
    assert start.input_tokens + start.cache_read_input_tokens == counted
    assert start.output_tokens == 0 and delta.output_tokens == 4
    whole = client.messages.create(model=NAME, messages=question, max_tokens=4).usage
    assert whole.input_tokens + (whole.cache_read_input_tokens or 0) == counted


def test_responses_stream_cut_short_is_incomplete(base):
    events = list(oai(base).responses.create(model=NAME, input="hi", max_output_tokens=2, stream=True))
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseIncompleteEvent)
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "Hello from" and [i.status for i in last.response.output] == ["incomplete"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]
    full = list(oai(base).responses.create(model=NAME, input="hi", stream=True))
    assert full[-1].type == "response.completed" and full[-1].response.output[0].status == "completed"
