"""The OpenAI protocol end to end: the openai SDK over real HTTP (hypercorn on port 0) against the
real server stack (GPU-worker thread, scheduler, admission, quart-trio app), serving tiny
checkpoints whose weights make greedy decoding emit a chosen token script (model/synth.py).

Tool calls, reasoning, stop sequences, logprobs and usage therefore go through the real
tokenizer, detokenizer, chat template, engine and text pipeline, streaming and not. Each model is
served once per module from a background thread running its own trio loop (real clock, real
threads); the tests are plain sync functions driving `openai.OpenAI` / `httpx`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

openai = pytest.importorskip("openai")

from model.text.tokenizer import Tokenizer  # noqa: E402
from tests.fixtures.synth import write_scripted_model_dir  # noqa: E402
from tests.live_http import serve_in_thread  # noqa: E402

WEATHER_ARGS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# Reasoning, prose, then one hermes call: every stage of the pipeline in one reply.
HERMES_SCRIPT = (
    "<think>",
    "The user",
    " wants weather.",
    "</think>",
    "Let me check",
    "<tool_call>",
    WEATHER_ARGS,
    "</tool_call>",
)
MALFORMED_SCRIPT = ("Sure:", "<tool_call>", "{not json", "</tool_call>")
# Served with a template that leaves `<think>` open and teaches qwen3-coder's XML call format.
CODER_SCRIPT = (
    "Hmm,",
    " pondering.",
    "</think>",
    "Calling.",
    "<tool_call>",
    "<function=get_weather>",
    "<parameter=city>",
    "Paris",
    "</parameter>",
    "</function>",
    "</tool_call>",
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'

CODER_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\\nCall tools as <tool_call>\\n<function=NAME>\\n'
    + '<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n<think>\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- serving a model dir over real HTTP from a background thread -----------------------------


@attrs.frozen(eq=False)
class Served:
    base: str  # http://127.0.0.1:<port>
    client: Any  # openai.OpenAI
    tokenizer: Tokenizer
    model_dir: Path

    def ids(self, pieces: Sequence[str]) -> list[int]:
        return [self.tokenizer.token_to_id(p) for p in pieces]

    @property
    def eos(self) -> int:
        return self.tokenizer.token_to_id("<|im_end|>") or self.tokenizer.token_to_id("<|eot_id|>")

    def raw(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.base + path, json=body, timeout=60)

    def sse(self, path: str, body: dict[str, Any]) -> list[str]:
        """The data payloads of a stream, in order ("[DONE]" included)."""
        text = httpx.post(self.base + path, json={**body, "stream": True}, timeout=60).text
        assert text.endswith("\n\n")
        return [frame.removeprefix("data: ") for frame in text.split("\n\n") if frame]


@contextmanager
def served(model_dir: Path, **config: Any) -> Iterator[Served]:
    # served as "m", the name these tests' requests carry (any other name is a 404)
    with serve_in_thread(model_dir, **{"served_model_name": ("m",), **config}) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        try:
            yield Served(base, client, Tokenizer.from_dir(model_dir), model_dir)
        finally:
            client.close()


def _model(tmp_path_factory: pytest.TempPathFactory, name: str, script: Sequence[str], **kw: Any) -> Path:
    return write_scripted_model_dir(tmp_path_factory.mktemp(name), list(script), **kw)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(_model(tmp_path_factory, "hermes", HERMES_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def malformed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(_model(tmp_path_factory, "malformed", MALFORMED_SCRIPT)) as server:
        yield server


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = _model(tmp_path_factory, "coder", CODER_SCRIPT)
    (model_dir / "chat_template.jinja").write_text(CODER_TEMPLATE, encoding="utf-8")  # wins over the config's
    with served(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(_model(tmp_path_factory, "llama", (LLAMA_CALL,), family="llama", template="llama3")) as server:
        yield server


def chat(server: Served, **kw: Any) -> Any:
    return server.client.chat.completions.create(model="m", messages=kw.pop("messages", USER), **kw)


def collect_stream(server: Served, **kw: Any) -> dict[str, Any]:
    """Drive an SDK stream; return what a client assembles from it."""
    chunks = list(chat(server, stream=True, **kw))
    out: dict[str, Any] = {"chunks": chunks, "content": "", "reasoning": "", "tool_calls": [], "finish": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
        for piece in delta.tool_calls or []:  # a call streams: its header, then argument pieces
            if piece.index == len(out["tool_calls"]):
                out["tool_calls"].append(piece.model_copy(deep=True))
            else:
                out["tool_calls"][piece.index].function.arguments += piece.function.arguments
        if choice.finish_reason:
            out["finish"].append(choice.finish_reason)
    return out


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning")


# --- hermes: reasoning + prose + a tool call ------------------------------------------------


def test_tool_call_with_reasoning_non_stream(hermes):
    result = chat(hermes, tools=TOOLS)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert reasoning_of(choice.message) == "The user wants weather."
    assert choice.message.content == "Let me check"  # prose before the marker is content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = hermes.tokenizer.encode_chat(USER, tools=TOOLS)
    assert result.usage.prompt_tokens == len(prompt)
    assert result.usage.completion_tokens == len(HERMES_SCRIPT) + 1  # EOS counts, as in mlx-lm
    assert result.usage.total_tokens == len(prompt) + len(HERMES_SCRIPT) + 1
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_tool_call_with_reasoning_stream(hermes):
    got = collect_stream(hermes, tools=TOOLS, stream_options={"include_usage": True})
    chunks = got["chunks"]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    assert got["reasoning"] == "The user wants weather." and got["content"] == "Let me check"
    [call] = got["tool_calls"]
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert got["finish"] == ["tool_calls"]
    final = chunks[-1]  # include_usage: a last chunk with no choices
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert final.choices == [] and final.usage.completion_tokens == len(HERMES_SCRIPT) + 1
    assert final.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])  # usage only on the last chunk
    # reasoning deltas come before content, the tool call after both
    kinds = []
    for chunk in chunks[1:-1]:
        delta = chunk.choices[0].delta
        kinds += [
            k
            for k, v in (
                ("reasoning", (delta.model_extra or {}).get("reasoning")),
                ("content", delta.content),
                ("tool_calls", delta.tool_calls),
            )
            if v
        ]
    assert kinds == sorted(kinds, key=["reasoning", "content", "tool_calls"].index) and kinds[-1] == "tool_calls"


def test_raw_stream_frames_end_with_a_bare_done(hermes):
    frames = hermes.sse("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
    markup = "".join(json.dumps(c["choices"][0]["delta"]) for c in chunks)
    assert "<tool_call>" not in markup and "<think>" not in markup  # markup is never streamed


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "none"}], ids=["no-tools", "tool_choice-none"])
def test_without_tools_the_markup_is_content(hermes, extra):
    body = {"tools": TOOLS, **extra} if extra else {}
    choice = chat(hermes, **body).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == f"Let me check<tool_call>{WEATHER_ARGS}</tool_call>"
    assert reasoning_of(choice.message) == "The user wants weather."


def test_stop_string_across_tokens_inside_reasoning(hermes):
    # "user wants" spans the pieces "The user" + " wants weather." and lies inside <think>.
    choice = chat(hermes, tools=TOOLS, stop=["user wants"]).choices[0]
    assert choice.finish_reason == "stop"
    assert reasoning_of(choice.message) == "The "
    assert choice.message.content == "" and choice.message.tool_calls is None
    got = collect_stream(hermes, tools=TOOLS, stop=["user wants"])
    assert (got["reasoning"], got["content"], got["tool_calls"], got["finish"]) == ("The ", "", [], ["stop"])


def test_stop_string_in_content_drops_the_rest_and_the_tool_call(hermes):
    for stream in (False, True):
        if stream:
            got = collect_stream(hermes, tools=TOOLS, stop="me ch")
            content, reasoning, calls, finish = got["content"], got["reasoning"], got["tool_calls"], got["finish"][0]
        else:
            choice = chat(hermes, tools=TOOLS, stop="me ch").choices[0]
            content, reasoning = choice.message.content, reasoning_of(choice.message)
            calls, finish = choice.message.tool_calls or [], choice.finish_reason
        assert (content, reasoning, calls, finish) == ("Let ", "The user wants weather.", [], "stop")


def test_stop_string_spanning_think_tag_matches_raw_text(hermes):
    # The stop matcher runs before the think splitter: tags are part of the text it sees.
    choice = chat(hermes, stop=["weather.</think>Let"]).choices[0]
    assert choice.finish_reason == "stop"
    assert reasoning_of(choice.message) == "The user wants " and choice.message.content == ""


def test_logprobs_top_k_form_non_stream(hermes):
    data = hermes.raw("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2}).json()
    content = data["choices"][0]["logprobs"]["content"]
    expected = hermes.ids(HERMES_SCRIPT) + [hermes.eos]
    assert len(content) == data["usage"]["completion_tokens"] == len(expected)
    assert [entry["id"] for entry in content] == expected  # greedy: the top candidate is the sampled one
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 2 and entry == {**top[0], "top_logprobs": top}
        assert top[0]["logprob"] >= top[1]["logprob"] and top[0]["logprob"] <= 0
        assert all(t["token"] == hermes.tokenizer.id_to_token(t["id"]) for t in top)


def test_logprobs_sampled_form(hermes):
    data = hermes.raw("/v1/chat/completions", {"messages": USER, "logprobs": True}).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert [set(e) for e in content] == [{"id", "logprob"}] * len(content)
    assert [e["id"] for e in content] == hermes.ids(HERMES_SCRIPT) + [hermes.eos]
    plain = hermes.raw("/v1/chat/completions", {"messages": USER}).json()
    assert "logprobs" not in plain["choices"][0]
    frames = hermes.sse("/v1/chat/completions", {"messages": USER})
    assert frames[-1] == "[DONE]" and all("logprobs" not in json.loads(f)["choices"][0] for f in frames[:-1])


@pytest.mark.parametrize(
    "fields",
    [{"top_logprobs": 3}, {"tools": TOOLS}, {"tools": TOOLS, "stop": ["me ch"]}, {"stop": ["user wants"]}],
)
def test_stream_logprobs_concatenate_to_the_whole_answers(hermes, fields):
    whole = chat(hermes, logprobs=True, **fields)
    expected = [entry.model_dump(exclude_unset=True) for entry in whole.choices[0].logprobs.content]
    assert len(expected) == whole.usage.completion_tokens
    got = collect_stream(hermes, logprobs=True, **fields)
    streamed = []
    for chunk in got["chunks"]:
        logprobs = chunk.choices[0].logprobs
        streamed += [entry.model_dump(exclude_unset=True) for entry in logprobs.content] if logprobs else []
    assert streamed == expected
    reasoning_chunks = [c for c in got["chunks"] if (c.choices[0].delta.model_extra or {}).get("reasoning")]
    assert reasoning_chunks and all(c.choices[0].logprobs.content for c in reasoning_chunks)


def test_tool_result_turn_is_templated(hermes):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "input_text", "text": "brief."}]},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    result = chat(hermes, messages=messages, tools=TOOLS)
    templated = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    assert result.usage.prompt_tokens == len(hermes.tokenizer.encode_chat(templated, tools=TOOLS))
    assert result.choices[0].finish_reason == "tool_calls"


def test_repeated_prompt_reports_cached_tokens(hermes):
    messages = [{"role": "user", "content": "cache me if you can, please"}]
    chat(hermes, messages=messages)
    second = chat(hermes, messages=messages)
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_text_completions_are_untemplated_and_unsplit(hermes):
    whole = hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=50)
    assert whole.choices[0].text == "".join(HERMES_SCRIPT) and whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens == len(hermes.tokenizer.encode("Hello there"))
    ids = hermes.tokenizer.encode("Hello there")
    by_ids = hermes.client.completions.create(model="m", prompt=ids, max_tokens=3)
    assert by_ids.choices[0].text == "<think>The user wants weather." and by_ids.choices[0].finish_reason == "length"
    stream = hermes.client.completions.create(
        model="m", prompt="Hello there", stop=["check<tool"], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == "<think>The user wants weather.</think>Let me "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_text_completions_logprobs_in_the_legacy_shape_and_echo(hermes):
    whole = hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=3, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert logprobs.tokens == list(HERMES_SCRIPT[:3]) and "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset == [0, len(HERMES_SCRIPT[0]), len(HERMES_SCRIPT[0]) + len(HERMES_SCRIPT[1])]
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs.token_logprobs)
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == lp  # the 2 alternatives and the sampled token
    sampled_only = hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=2, logprobs=0)
    assert [list(top) for top in sampled_only.choices[0].logprobs.top_logprobs] == [[t] for t in HERMES_SCRIPT[:2]]
    chunks = list(
        hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=3, logprobs=1, stream=True)
    )
    streamed = [token for c in chunks if c.choices[0].logprobs for token in c.choices[0].logprobs.tokens]
    assert streamed == list(HERMES_SCRIPT[:3]) and "".join(streamed) == "".join(c.choices[0].text for c in chunks)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset  # counted across the whole stream
    with pytest.raises(openai.BadRequestError) as bad:  # chat's boolean is not the legacy API's
        hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=2, logprobs=True)
    assert bad.value.body["param"] == "logprobs"
    echoed = hermes.client.completions.create(model="m", prompt="Hello there", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "Hello there" + "".join(HERMES_SCRIPT[:2])
    ids = hermes.tokenizer.encode("Hello there")
    by_ids = hermes.client.completions.create(model="m", prompt=ids, max_tokens=1, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in by_ids) == hermes.tokenizer.decode(ids) + HERMES_SCRIPT[0]


def test_models_card_and_errors_through_the_sdk(hermes):
    [card] = hermes.client.models.list().data
    extra = card.model_extra
    assert card.object == "model" and extra["context_window"] == 4096 and extra["reasoning"] is True
    assert extra["capabilities"]["chat_completions"] and extra["capabilities"]["logprobs"]
    with pytest.raises(openai.BadRequestError) as bad:
        chat(hermes, reasoning_effort="hihg")
    assert bad.value.body["message"] == (
        "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'"
    )
    with pytest.raises(openai.BadRequestError) as bad:
        chat(hermes, top_logprobs=12)
    assert bad.value.body["message"] == "top_logprobs must be at most 11"
    with pytest.raises(openai.BadRequestError):
        chat(hermes, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert httpx.get(hermes.base + "/v1/nope").status_code == 404
    assert httpx.get(hermes.base + "/v1/chat/completions").status_code == 405


# --- malformed markup, open <think> + qwen3-coder, llama-3 JSON ------------------------------


def test_malformed_tool_markup_is_returned_as_content(malformed):
    choice = chat(malformed, tools=TOOLS).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "Sure:<tool_call>{not json</tool_call>"
    got = collect_stream(malformed, tools=TOOLS)
    assert (got["content"], got["tool_calls"], got["finish"]) == ("Sure:<tool_call>{not json</tool_call>", [], ["stop"])


def test_prompt_open_think_and_qwen3_coder_calls(coder):
    choice = chat(coder, tools=TOOLS).choices[0]
    assert reasoning_of(choice.message) == "Hmm, pondering."
    assert choice.message.content == "Calling." and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    got = collect_stream(coder, tools=TOOLS)
    assert (got["reasoning"], got["content"], got["finish"]) == ("Hmm, pondering.", "Calling.", ["tool_calls"])
    assert json.loads(got["tool_calls"][0].function.arguments) == {"city": "Paris"}


def test_prompt_open_think_without_tools(coder):
    choice = chat(coder).choices[0]
    assert reasoning_of(choice.message) == "Hmm, pondering."
    assert choice.message.content.startswith("Calling.<tool_call><function=get_weather>")
    assert choice.finish_reason == "stop"


def test_llama3_json_tool_call(llama):
    choice = chat(llama, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    got = collect_stream(llama, tools=TOOLS)
    assert got["content"] == "" and got["finish"] == ["tool_calls"]
    assert json.loads(got["tool_calls"][0].function.arguments) == {"city": "Paris", "days": 3}
    plain = chat(llama).choices[0]
    assert plain.message.content == LLAMA_CALL and plain.finish_reason == "stop"


# --- sampling fields on the real engine ---------------------------------------------------------


def test_every_sampling_field_runs_on_the_real_engine(hermes):
    result = chat(
        hermes,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        max_tokens=20,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.1,
            "repetition_penalty": 1.1,
            "repetition_context_size": 8,
            "presence_penalty": 0.1,
            "presence_context_size": 8,
            "frequency_penalty": 0.1,
            "frequency_context_size": 8,
        },
        logit_bias={"3": 0.5},
    )
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert result.usage.model_extra["lane"] == "batched"  # a seeded row stays in the batch (per-row RNG)


@pytest.mark.slow
def test_extreme_but_valid_values_are_not_500(hermes):
    bound = 2**31 - 1  # counts and windows fit 32 bits
    body = {
        "messages": USER,
        "temperature": 2,
        "top_k": bound,
        "seed": 2**70,
        "max_tokens": bound,
        "repetition_penalty": 100,
        "repetition_context_size": bound,
        "presence_penalty": 2,
        "presence_context_size": bound,
        "frequency_penalty": -2,
        "frequency_context_size": bound,
        "logit_bias": {"0": -100},
        "logprobs": True,
        "top_logprobs": 11,
    }
    response = hermes.raw("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e300),
        ("top_k", 2**70),
        ("max_tokens", 2**70),
        ("repetition_context_size", 2**70),
        ("presence_penalty", 1e30),
        ("frequency_penalty", -1e30),
        ("logit_bias", {"0": -1e30}),
    ],
)
def test_absurd_values_are_a_400_not_a_500(hermes, field, value):
    response = hermes.raw("/v1/chat/completions", {"messages": USER, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_logit_bias_bans_a_scripted_token(hermes):
    banned = hermes.tokenizer.token_to_id("The user")
    choice = chat(hermes, logit_bias={str(banned): -100}, max_tokens=4).choices[0]
    text = (reasoning_of(choice.message) or "") + (choice.message.content or "")
    assert "The user" not in text
    baseline = chat(hermes, max_tokens=4).choices[0]
    assert reasoning_of(baseline.message).startswith("The user")
