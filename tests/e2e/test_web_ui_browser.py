"""The chat page in a real browser: headless chromium (Selenium) against `python -m actors.serve`.

* A tiny random-weight model that does not end early: the page streams an answer, Stop aborts
  the fetch mid-stream and the server's request log records the client's abort; after a reload
  the conversation is in the list with both messages.
* The embedded demo model behind `--api-key`: the page asks for the key, sends it, shows the
  demo's scripted answer with TTFT and tokens/s, and after a reload still has the key and the
  conversation.
* The rendering of reasoning, a JSON answer and a tool call, from a stream in the server's chunk
  format fed to the page's fetch.

Skipped, with the reason, where selenium, chromium or chromedriver is missing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import make_driver, missing_browser, start_server, stop_server

pytestmark = pytest.mark.skipif(missing_browser() is not None, reason=f"browser test: {missing_browser()}")

KEY = "sk-browser-test"
WAIT_S = 60.0
LONG_ANSWER = 60_000  # max_tokens: far more than the tiny model generates before Stop


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def request_lines(log_path: Path) -> list[dict[str, Any]]:
    """The server's per-request log lines (api/observability/request_log.py), parsed."""
    found = re.findall(r"request (\{.*\})$", log_path.read_text(), flags=re.M)
    return [json.loads(line) for line in found]


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = make_driver()
    try:
        yield driver
    finally:
        driver.quit()


def by_css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def all_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def text_of(element: Any) -> str:
    return element.get_attribute("textContent") or ""


def texts(driver: Any, selector: str) -> list[str]:
    """The matching elements' text, read in one step: the page re-renders a message while it
    streams, so a held element reference can go stale between two reads."""
    script = "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent)"
    return list(driver.execute_script(script, selector))


def models_loaded(driver: Any) -> bool:
    return len(all_css(driver, "#model option")) > 0


def send_message(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_css(driver, "#input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def answer_text(driver: Any) -> str:
    answers = texts(driver, "#messages .message.assistant")
    return answers[-1] if answers else ""


def test_stream_stop_and_reload(browser, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=1 << 16)
    log_path = tmp_path / "server.log"
    proc, base = start_server(["--model", str(model_dir), "--served-model-name", "tiny"], log_path)
    try:
        browser.get(base + "/")
        wait_for(lambda: models_loaded(browser), "the model list")
        assert by_css(browser, "#model").get_attribute("value") == "tiny"
        assert not by_css(browser, "#attach").is_displayed()  # no vision: no image control

        # Settings: a long answer, kept in localStorage.
        by_css(browser, "#settings-toggle").click()
        max_tokens = by_css(browser, "#max_tokens")
        max_tokens.send_keys(str(LONG_ANSWER))
        by_css(browser, "#temperature").click()  # leaving the field fires its change event
        settings = browser.execute_script("return JSON.parse(localStorage.getItem('mlxTrio.settings'))")
        assert settings["max_tokens"] == str(LONG_ANSWER)
        by_css(browser, "#settings-toggle").click()

        send_message(browser, "hello there")
        wait_for(lambda: by_css(browser, "#stop").is_displayed(), "the Stop button")
        # Streamed: the answer grows while the request is still open.
        first = len(wait_for(lambda: answer_text(browser).strip() and answer_text(browser), "streamed text"))
        wait_for(lambda: len(answer_text(browser)) > first + 20, "more streamed text")
        assert by_css(browser, "#stop").is_displayed()

        by_css(browser, "#stop").click()
        wait_for(lambda: by_css(browser, "#send").is_displayed(), "the Send button after Stop")
        stopped_text = answer_text(browser)
        assert "stopped" in texts(browser, "#messages .message.assistant .stats")[-1]

        # The server saw the client leave mid-stream.
        def chat_line() -> dict[str, Any] | None:
            lines = [r for r in request_lines(log_path) if r["route"] == "/v1/chat/completions"]
            return lines[-1] if lines else None

        line = wait_for(chat_line, "the chat request's log line", timeout=20)
        assert line["finish_reason"] == "abort" and line["abort_cause"] == "client" and line["client_abort"], line
        assert line["status"] in (200, 499), line
        assert 0 < line["generated_tokens"] < LONG_ANSWER, line

        # After a reload the conversation is listed, with both messages and the partial answer.
        browser.refresh()
        wait_for(lambda: models_loaded(browser), "the model list after reload")
        assert texts(browser, "#conversations .conversation .open") == ["hello there"]
        messages = all_css(browser, "#messages .message")
        assert [m.get_attribute("class") for m in messages] == ["message user", "message assistant"]
        assert texts(browser, "#messages .message.user .content") == ["hello there"]
        assert answer_text(browser)[:40] == stopped_text[:40]
        assert by_css(browser, "#max_tokens").get_attribute("value") == str(LONG_ANSWER)

        # The markdown renderer escapes before it formats.
        html = browser.execute_script(
            "return renderMarkdown(arguments[0])",
            "<img src=x onerror=alert(1)> **bold** [x](javascript:alert(1))\n```py\n<b>\n```",
        )
        assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
        assert "<strong>bold</strong>" in html and "href" not in html
        assert '<span class="code-lang">py</span><pre><code>&lt;b&gt;</code></pre>' in html
    finally:
        stop_server(proc)


def test_the_page_asks_for_the_api_key(browser, tmp_path):
    log_path = tmp_path / "server.log"
    proc, base = start_server(["--api-key", KEY], log_path)  # no --model: the embedded demo model
    try:
        browser.get(base + "/")
        dialog = wait_for(lambda: (d := by_css(browser, "#key-dialog")).get_attribute("open") is not None and d, "key")
        assert "needs an API key" in text_of(by_css(browser, "#key-message"))
        by_css(browser, "#key-input").send_keys(KEY)
        by_css(browser, "#key-ok").click()
        wait_for(lambda: models_loaded(browser), "the model list once the key is given")
        assert dialog.get_attribute("open") is None
        assert browser.execute_script("return localStorage.getItem('mlxTrio.apiKey')") == KEY

        send_message(browser, "who are you?")
        stats_shown = lambda: any("tok/s" in t for t in texts(browser, ".message.assistant .stats"))  # noqa: E731
        wait_for(stats_shown, "the answer's stats")
        [answer] = texts(browser, "#messages .message.assistant .content")
        assert "embedded demo model" in answer and "<path or Hugging Face repo id>" in answer
        [stats] = texts(browser, "#messages .message.assistant .stats")
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · 14 tokens · finish: stop", stats), stats

        # The server saw one refused models call, then only keyed ones.
        lines = request_lines(log_path)
        assert [line["status"] for line in lines if line["route"].startswith("/v1/models")][:2] == [401, 200]
        chat = [line for line in lines if line["route"] == "/v1/chat/completions"]
        assert [line["status"] for line in chat] == [200] and chat[0]["finish_reason"] == "stop"

        browser.refresh()
        wait_for(lambda: models_loaded(browser), "the model list after reload (key kept)")
        assert by_css(browser, "#key-dialog").get_attribute("open") is None
        assert "embedded demo model" in texts(browser, "#messages .message.assistant .content")[0]
        assert texts(browser, "#conversations .conversation .open") == ["who are you?"]
    finally:
        stop_server(proc)


# The server's own chunk format (api/openai/encode.py), cut into uneven pieces: a model that
# thinks, answers with JSON and calls a tool. The page's fetch is replaced for this one request,
# so the rendering of each part is checked with a known stream.
FAKE_STREAM = """
const frames = [
  {choices: [{index: 0, delta: {role: "assistant", content: ""}, finish_reason: null}]},
  {choices: [{index: 0, delta: {reasoning: "Let me "}, finish_reason: null}]},
  {choices: [{index: 0, delta: {reasoning: "think."}, finish_reason: null}]},
  {choices: [{index: 0, delta: {content: '{"city": "Paris",'}, finish_reason: null}]},
  {choices: [{index: 0, delta: {content: ' "temp": 21}'}, finish_reason: null}]},
  {choices: [{index: 0, delta: {tool_calls: [{index: 0, id: "call_1", type: "function",
    function: {name: "get_weather", arguments: '{"city":"Paris"}'}}]}, finish_reason: null}]},
  {choices: [{index: 0, delta: {}, finish_reason: "tool_calls"}]},
  {choices: [], usage: {prompt_tokens: 5, completion_tokens: 7, total_tokens: 12}},
];
const text = frames.map((f) => `data: ${JSON.stringify(f)}\\n\\n`).join("") + "data: [DONE]\\n\\n";
const bytes = new TextEncoder().encode(text);
const realFetch = window.fetch;
window.sentBodies = [];
window.fetch = (url, init) => {
  if (!init || init.method !== "POST") return realFetch(url, init);
  window.sentBodies.push(JSON.parse(init.body));
  const body = new ReadableStream({
    start(controller) {
      for (let i = 0; i < bytes.length; i += 7) controller.enqueue(bytes.slice(i, i + 7));
      controller.close();
    },
  });
  return Promise.resolve(new Response(body, {status: 200, headers: {"Content-Type": "text/event-stream"}}));
};
"""


def test_reasoning_json_and_tool_calls_render(browser, tmp_path):
    proc, base = start_server([], tmp_path / "server.log")
    try:
        browser.get(base + "/")
        wait_for(lambda: models_loaded(browser), "the model list")
        browser.execute_script(FAKE_STREAM)
        send_message(browser, "weather in Paris?")
        wait_for(lambda: texts(browser, ".message.assistant .stats"), "the answer's stats")
        assert texts(browser, ".message.assistant details.reasoning summary") == ["Reasoning"]
        assert texts(browser, ".message.assistant .reasoning-text") == ["Let me think."]
        assert texts(browser, ".message.assistant .content pre.json") == ['{\n  "city": "Paris",\n  "temp": 21\n}']
        assert texts(browser, ".tool-call .tool-name") == ["tool call: get_weather"]
        assert texts(browser, ".tool-call pre.json") == ['{\n  "city": "Paris"\n}']
        [stats] = texts(browser, ".message.assistant .stats")
        assert stats.endswith("7 tokens · finish: tool_calls"), stats
        [sent] = browser.execute_script("return window.sentBodies")
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        assert sent["model"] == "mlx-trio-demo" and sent["messages"] == [
            {"role": "user", "content": "weather in Paris?"}
        ]
    finally:
        stop_server(proc)
