"""Headless chromium through Selenium, and a real server to point it at: shared by the chat
page's browser test (tests/e2e/test_web_ui_browser.py) and benchmarks/ui_screenshots.py.

Debian's packages: `apt-get install chromium chromium-driver`, `pip install selenium`. The
driver is always given chromedriver's path, so Selenium never tries to download one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.e2e.server_process import wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver",)


def missing_browser() -> str | None:
    """Why a browser cannot be driven here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not any(shutil.which(name) for name in BROWSERS):
        return "no chromium found (apt-get install chromium)"
    if not any(shutil.which(name) for name in DRIVERS) and not Path("/usr/lib/chromium/chromedriver").exists():
        return "no chromedriver found (apt-get install chromium-driver)"
    return None


def make_driver(width: int = 1280, height: int = 860) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(p for p in map(shutil.which, BROWSERS) if p)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--force-prefers-reduced-motion",
    ):
        options.add_argument(argument)
    driver_path = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def start_server(args: Sequence[str], log_path: Path, limit_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`python -m actors.serve --port 0 ARGS`, its log (request lines included) in `log_path`."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "actors.serve", "--port", "0", *args],
            cwd=ROOT,
            stderr=log_file,
            stdout=log_file,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    return proc, wait_until_serving(proc, log_path, limit_s)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
