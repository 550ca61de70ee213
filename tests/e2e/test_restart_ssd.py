"""Restart survival, end to end: `python -m actors.serve --ssd-cache DIR` as a subprocess.

A multi-turn conversation is served, the server gets Ctrl-C (its shutdown flush makes every
put durable, exit 0), a new server starts on the same directory, and the next turn reports
cached tokens restored from disk; its greedy output equals a cold server's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.server_process import ROOT, Server, free_port

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
