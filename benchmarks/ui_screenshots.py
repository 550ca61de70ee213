"""Screenshots of the chat page for docs/ui.md: a real server on the embedded demo model, driven
by headless chromium (tests/e2e/browser.py), one streamed conversation and the settings panel.

    python benchmarks/ui_screenshots.py            # writes docs/images/ui-chat.png, ui-settings.png

Needs `apt-get install chromium chromium-driver` and `pip install selenium`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.browser import ROOT, make_driver, missing_browser, start_server, stop_server  # noqa: E402

OUT = ROOT / "docs" / "images"
QUESTIONS = ("Hi! What are you?", "And how do I serve a real model?")


def wait_for(condition, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise SystemExit("timed out")


def main() -> int:
    if reason := missing_browser():
        print(reason, file=sys.stderr)
        return 1
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server([], Path(tmp) / "server.log")
        driver = make_driver(1280, 760)
        try:
            driver.get(base + "/")
            wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"))
            for n, question in enumerate(QUESTIONS, start=1):
                driver.find_element(By.ID, "input").send_keys(question, Keys.ENTER)
                wait_for(lambda n=n: len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant .stats")) == n)
            driver.save_screenshot(str(OUT / "ui-chat.png"))
            driver.find_element(By.ID, "settings-toggle").click()
            for field, value in (("temperature", "0.7"), ("top_p", "0.95"), ("max_tokens", "512")):
                driver.find_element(By.ID, field).send_keys(value)
            driver.find_element(By.ID, "system").send_keys("You are a concise assistant.")
            driver.find_element(By.ID, "input").click()
            driver.save_screenshot(str(OUT / "ui-settings.png"))
        finally:
            driver.quit()
            stop_server(proc)
    print(f"wrote {OUT / 'ui-chat.png'} and {OUT / 'ui-settings.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
