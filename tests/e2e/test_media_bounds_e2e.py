"""Issue 43's image finding, on a real `python -m actors.serve` subprocess: the tiny Qwen2.5-VL
checkpoint with Qwen2.5-VL's own image bounds (12.8 Mpx after resizing) and a 128k-token window.
Eight solid 8192x8192 PNGs in one request (a ~2 MB body) once took 27 s of CPU and 3.6 GB before
their 400, and three at once starved a plain chat for 25.8 s. Now each such request is refused
from the headers in under a second, three at once raise the server's peak resident memory
(VmHWM, reset through /proc/PID/clear_refs) by under 100 MB, and a plain chat sent alongside
answers in its usual time."""

from __future__ import annotations

import base64
import json
import statistics
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import end, launch_quick, wait_until_serving
from tests.fixtures.vlm import PREPROCESSOR, write_vlm_dir

SIDE = 8192
IMAGES = 8
CONTEXT = 128_000  # Qwen2.5-VL's window: 8 images of 16 384 tokens cannot fit it
MB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")


def solid_png(side: int) -> bytes:
    """A side x side solid RGB PNG, compressed row by row (never whole in memory)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    ihdr = side.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    compressor = zlib.compressobj(9)
    row = b"\0" + bytes([200, 30, 40]) * side
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    tmp = tmp_path_factory.mktemp("media_e2e")
    model_dir = write_vlm_dir(tmp / "vlm", max_position_embeddings=CONTEXT)
    preprocessor = {**PREPROCESSOR, "max_pixels": 12_845_056}  # Qwen2.5-VL's own
    (model_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor), encoding="utf-8")
    proc = launch_quick(["--model", str(model_dir)], tmp / "server.log")
    try:
        yield wait_until_serving(proc, tmp / "server.log", limit_s=120), proc.pid
    finally:
        end(proc)


def status_kb(pid: int, key: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith(key + ":"))


def plain_chat(base: str) -> float:
    """Seconds for a short chat's answer."""
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}
    started = time.monotonic()
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def test_eight_huge_pngs_are_refused_fast_and_small_beside_a_plain_chat(served):
    base, pid = served
    url = "data:image/png;base64," + base64.b64encode(solid_png(SIDE)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}] * IMAGES + [{"type": "text", "text": "what?"}]
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()
    assert 1.5 * MB < len(body) < 4 * MB

    plain_chat(base)  # warm: the first answer compiles
    alone = statistics.median(plain_chat(base) for _ in range(5))

    def huge() -> tuple[float, int, dict]:
        started = time.monotonic()
        response = httpx.post(
            f"{base}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=120
        )
        return time.monotonic() - started, response.status_code, response.json()

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the server's peak restarts from here
    rss_before = status_kb(pid, "VmRSS")
    with ThreadPoolExecutor(4) as pool:
        refused = [pool.submit(huge) for _ in range(3)]
        time.sleep(0.05)  # the bodies are on their way in
        beside = pool.submit(plain_chat, base)
        answers = [f.result() for f in refused]
        beside_s = beside.result()
    growth_mb = (status_kb(pid, "VmHWM") - rss_before) / 1024

    for seconds, status, answer in answers:
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "prompt is too long" in answer["error"]["message"], answer
        assert seconds < 1.0, answers
    assert growth_mb < 100, growth_mb
    assert beside_s < max(5 * alone, alone + 1.0), (beside_s, alone)
