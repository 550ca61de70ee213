"""Speculative decoding through a real `python -m actors.serve` subprocess and a tiny model: a
`--draft-kind ngram` server reports `speculation` in usage and /stats; a draft model with another
tokenizer vocabulary is a one-line start-up failure (exit 2).

Acceptance counts are the engine's business (tests/model); here only the fields' shapes."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.e2e.server_process import end, wait_until_serving
from tests.e2e.server_process import launch_quick as launch

STARTUP_LIMIT_S = 120.0

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def is_counts(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"drafted", "accepted"}
        and all(isinstance(v, int) for v in value.values())
        and 0 <= value["accepted"] <= value["drafted"]
    )


def test_an_ngram_server_reports_speculation_in_usage_and_stats(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3")
    log_path = tmp_path / "server.log"
    proc = launch(["--model", str(model_dir), "--draft-kind", "ngram"], log_path)
    try:
        base = wait_until_serving(proc, log_path, STARTUP_LIMIT_S)
        prompt = "one two three four one two three four one two three"
        text = httpx.post(
            f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60
        ).json()
        assert is_counts(text["usage"]["speculation"]), text["usage"]
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0},
            timeout=60,
        ).json()
        assert is_counts(chat["usage"]["speculation"]), chat["usage"]
        message = httpx.post(
            f"{base}/v1/messages",
            json={"max_tokens": 8, "messages": [{"role": "user", "content": prompt}]},
            timeout=60,
        ).json()
        assert is_counts(message["usage"]["speculation"]), message["usage"]
        stats = httpx.get(f"{base}/stats", timeout=10).json()["speculation"]
        assert stats["mode"] == "ngram k=3 n=2..4"
        assert is_counts({"drafted": stats["drafted"], "accepted": stats["accepted"]}), stats
        assert stats["acceptance"] is None if stats["drafted"] == 0 else 0 <= stats["acceptance"] <= 1
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert "mlx_trio:spec_drafted_tokens_total" in metrics and "mlx_trio:spec_accepted_tokens_total" in metrics
    finally:
        code = end(proc)
    assert code == 0, log_path.read_text()[-3000:]


def test_a_draft_model_with_another_vocabulary_fails_in_one_line(tiny_model_factory, tmp_path):
    target = tiny_model_factory("qwen3")
    other = tiny_model_factory("qwen3", tokenizer_vocab=300)
    log_path = tmp_path / "failed.log"
    proc = launch(["--model", str(target), "--draft-model", str(other)], log_path)
    try:
        code = proc.wait(timeout=60)
    finally:
        end(proc)
    log = log_path.read_text()
    assert code == 2, log
    assert "Traceback" not in log and "ExceptionGroup" not in log, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot serve: " in errors[0], log
    assert "tokenizer vocabularies differ" in errors[0] and str(target) in errors[0] and str(other) in errors[0]
