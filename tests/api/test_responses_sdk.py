"""The OpenAI Responses surface end to end: the official `openai` SDK (`client.responses`) over
real HTTP against the real stack, serving tiny scripted checkpoints (see tests/test_anthropic_sdk.py
for the harness)."""

from __future__ import annotations

import pytest

from tests.helpers.live import (
    TEXT_SCRIPT,
    THINK_SCRIPT,
    TOOL_SCRIPT,
    WEATHER_SCHEMA,
    Live,
    live_server,
    scripted,
)

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_SCHEMA}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rtext", TEXT_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rtool", TOOL_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rthink", THINK_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def failing_server(tmp_path_factory):
    with live_server(scripted(tmp_path_factory, "rfailing", TEXT_SCRIPT), failing=True) as server:
        yield server


def sdk(server: Live):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=60)


def prompt_len(server: Live, messages: list[dict]) -> int:
    return len(server.tokenizer.encode_chat(messages))


def test_create_non_stream(text_server):
    response = sdk(text_server).responses.create(model="m", input=QUESTION, instructions="Be brief.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.error is None
    assert response.output_text == "".join(TEXT_SCRIPT)
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.instructions == "Be brief."
    usage = response.usage
    assert usage.input_tokens == prompt_len(
        text_server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    )
    assert (
        usage.output_tokens == len(TEXT_SCRIPT) + 1 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    )
    assert usage.output_tokens_details.reasoning_tokens == 0
    short = sdk(text_server).responses.create(model="m", input=QUESTION, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == "Hello from"


def test_stream_events_in_order(text_server):
    events = list(sdk(text_server).responses.create(model="m", input=QUESTION, stream=True))
    types = [event.type for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(TEXT_SCRIPT),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == list(TEXT_SCRIPT)
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "".join(TEXT_SCRIPT)
    assert final.id == events[0].response.id and final.usage.output_tokens == len(TEXT_SCRIPT) + 1
    # the SDK's stream helper assembles the same response
    with sdk(text_server).responses.stream(model="m", input=QUESTION) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assembled = stream.get_final_response()
    assert deltas == assembled.output_text == "".join(TEXT_SCRIPT)


def test_function_call_round_trip(tool_server):
    client = sdk(tool_server)
    first = client.responses.create(model="m", input=QUESTION, tools=TOOLS)
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert first.output[0].content[0].text == "I will check."
    call = first.output[1]
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}' and call.call_id
    assert first.status == "completed"

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    # stateless: the whole history in `input`
    replay = client.responses.create(
        model="m",
        tools=TOOLS,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in first.output],
            output,
        ],
    )
    # stateful: only the tool output, continuing from the stored response
    resumed = client.responses.create(model="m", tools=TOOLS, previous_response_id=first.id, input=[output])
    assert replay.usage.input_tokens == resumed.usage.input_tokens > first.usage.input_tokens
    assert resumed.previous_response_id == first.id

    streamed = list(client.responses.create(model="m", input=QUESTION, tools=TOOLS, stream=True))
    types = [event.type for event in streamed]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert done.arguments == '{"city": "Paris"}'
    assert [item.type for item in streamed[-1].response.output] == ["message", "function_call"]


def test_previous_response_id_continuation(text_server):
    client = sdk(text_server)
    first = client.responses.create(model="m", input="Hi there.", instructions="Be brief.")
    second = client.responses.create(model="m", input="Tell me more.", previous_response_id=first.id)
    said = "".join(TEXT_SCRIPT)
    assert second.usage.input_tokens == prompt_len(
        text_server,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": said},
            {"role": "user", "content": "Tell me more."},
        ],
    )
    assert second.instructions == "Be brief." and second.previous_response_id == first.id
    # a streamed continuation is stored too, so it can be continued again
    with client.responses.stream(model="m", input="Again.", previous_response_id=second.id) as stream:
        third = stream.get_final_response()
    fourth = client.responses.create(model="m", input="Last.", previous_response_id=third.id)
    assert fourth.usage.input_tokens > third.usage.input_tokens > second.usage.input_tokens
    assert client.responses.retrieve(third.id).output_text == said


def test_input_items_list_parses_with_the_sdk(tool_server):
    client = sdk(tool_server)
    first = client.responses.create(model="m", input="Hello", tools=TOOLS)
    [hello] = client.responses.input_items.list(first.id).data
    assert (hello.type, hello.role, hello.status, hello.content[0].text) == ("message", "user", "completed", "Hello")
    call = first.output[1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
    resumed = client.responses.create(model="m", tools=TOOLS, previous_response_id=first.id, input=[output])
    items = list(client.responses.input_items.list(resumed.id, order="asc", limit=2))  # the SDK pages with `after`
    assert [item.type for item in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[1].content[0].type == "output_text" and items[1].id == first.output[0].id
    assert items[2].call_id == call.call_id and items[2].arguments == call.arguments and items[3].output == "Sunny"


def test_unknown_id_is_404(text_server):
    client = sdk(text_server)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_missing")
    assert info.value.body["message"] == "previous_response_id 'resp_missing' not found or expired"
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_missing")


def test_store_false_and_retrieve_delete(text_server):
    client = sdk(text_server)
    unstored = client.responses.create(model="m", input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="more", previous_response_id=unstored.id)
    kept = client.responses.create(model="m", input=QUESTION)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_reasoning_output(think_server):
    client = sdk(think_server)
    response = client.responses.create(model="m", input=QUESTION)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].summary[0].text == "Let me think."
    assert response.output_text == "The answer is 42."
    assert (
        response.usage.output_tokens_details.reasoning_tokens == 2
    )  # "Let me", " think.": the tokens between the markers
    events = list(client.responses.create(model="m", input=QUESTION, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert reasoning == "Let me think."
    # continuing drops the reasoning item: the prompt holds only the answer
    follow = client.responses.create(model="m", input="ok", previous_response_id=response.id)
    assert follow.usage.input_tokens == prompt_len(
        think_server,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "The answer is 42."},
            {"role": "user", "content": "ok"},
        ],
    )


def test_mid_stream_engine_failure_ends_with_error_and_failed(failing_server):
    failing_server.worker.fail_in = 2
    events = list(sdk(failing_server).responses.create(model="m", input=QUESTION, stream=True))
    types = [event.type for event in events]
    at = types.index("error")
    assert types[at:] == [
        "error",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    assert events[at].code == "server_error" and "injected engine failure" in events[at].message
    final = events[-1].response
    assert final.status == "failed" and final.error.code == "server_error"
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        sdk(failing_server).responses.retrieve(final.id)
    assert sdk(failing_server).responses.create(model="m", input=QUESTION).output_text == "".join(TEXT_SCRIPT)
