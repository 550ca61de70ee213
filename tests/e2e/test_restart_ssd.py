"""Restart survival, end to end: `python -m actors.serve --ssd-cache DIR` as a subprocess.

A multi-turn conversation is served, the server gets Ctrl-C (its shutdown flush makes every
put durable, exit 0), a new server starts on the same directory, and the next turn reports
cached tokens restored from disk; its greedy output equals a cold server's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ROOT, free_port, wait_healthy

SHUTDOWN_TIMEOUT = 10
# `actors.serve.main` with every SSD piece write slowed down first (cache.ssd_writer imports no
# MLX, so the server still binds its BLAS before MLX loads).
_SLOW_WRITES_SERVE = (
    "import sys; import cache.ssd_writer as writer; writer.PIECE_DELAY_S = {delay!r}; "
    "from actors.serve import main; sys.exit(main(sys.argv[1:]))"
)


class Server:
    """One `python -m actors.serve` subprocess on a free port; output collected in `log`.
    `piece_delay_s` > 0 sleeps that long before every SSD piece write (the crash test's kills
    then land mid-file)."""

    def __init__(self, model_dir: Path, *args: str, piece_delay_s: float = 0.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        launcher = (
            ["-c", _SLOW_WRITES_SERVE.format(delay=float(piece_delay_s))] if piece_delay_s else ["-m", "actors.serve"]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "--model",
                str(model_dir),
                "--port",
                str(self.port),
                "--shutdown-timeout",
                str(SHUTDOWN_TIMEOUT),
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.client = httpx.Client(base_url=self.base, timeout=60)
        try:
            wait_healthy(self.base, self.proc, deadline_s=60)
        except AssertionError as e:
            self.kill()
            raise AssertionError(f"{e}; server log:\n{self.log[-4000:]}") from None
        except BaseException:
            self.kill()
            raise

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def chat(self, messages: list[dict], max_tokens: int = 8) -> dict:
        r = self.client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str, max_tokens: int = 6) -> dict:
        r = self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        return self.client.get("/stats").json()

    def stop(self) -> int:
        """Ctrl-C, then the exit code."""
        self.client.close()  # an idle keep-alive connection would hold hypercorn's graceful drain
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=SHUTDOWN_TIMEOUT * 2 + 20)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.client.close()
        self._reader.join(timeout=5)


SYSTEM = " ".join(f"rule{i} agents share long system prompts and keep state across turns" for i in range(40))


def test_ctrl_c_then_restart_restores_the_conversation_from_disk(qwen3_dir, tmp_path):
    ssd = tmp_path / "ssd"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    server = Server(qwen3_dir, "--ssd-cache", str(ssd))
    try:
        for turn in range(3):  # a conversation: each turn re-sends the history
            reply = server.chat(messages)
            if turn:
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the RAM tier
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"follow-up {turn}"},
            ]
        assert server.stop() == 0
    finally:
        server.kill()
    assert "shutdown flush: durable" in server.log, server.log
    prompt_tokens = reply["usage"]["prompt_tokens"]

    server = Server(qwen3_dir, "--ssd-cache", str(ssd))
    try:
        assert server.stats()["ssd_cache"]["entries"] >= 1
        warm = server.chat(messages)
        stats = server.stats()["ssd_cache"]
        assert server.stop() == 0
    finally:
        server.kill()
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt_tokens  # at least the whole previous turn's prompt came from disk
    assert stats["restores"] == 1 and stats["restore_failures"] == 0

    server = Server(qwen3_dir, "--prompt-cache", "0")
    try:
        cold = server.chat(messages)
    finally:
        server.kill()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert warm["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]


def test_ssd_cache_requires_the_ram_tier(qwen3_dir, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.serve",
            "--model",
            str(qwen3_dir),
            "--port",
            str(free_port()),
            "--prompt-cache",
            "0",
            "--ssd-cache",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--ssd-cache requires the RAM prompt cache" in proc.stderr + proc.stdout


@pytest.mark.parametrize("flag", ["--no-ssd-verify"])
def test_flags_parse(flag):
    from tests.helpers.options import parsed

    args = parsed(
        ["--ssd-cache", "/x", "--ssd-cache-max", "4", "--ssd-spill-queue", "0", "--ssd-demote-idle", "0", flag]
    )
    assert (
        args.ssd_cache_dir,
        args.ssd_cache_max_gb,
        args.ssd_spill_queue_gb,
        args.ssd_demote_idle_s,
        args.ssd_verify,
    ) == (
        "/x",
        4.0,
        0.0,
        0.0,
        False,
    )
    defaults = parsed([])
    assert (
        defaults.ssd_cache_dir,
        defaults.ssd_cache_max_gb,
        defaults.ssd_spill_queue_gb,
        defaults.ssd_demote_idle_s,
        defaults.ssd_verify,
    ) == (None, 32.0, 2.0, 300.0, True)
