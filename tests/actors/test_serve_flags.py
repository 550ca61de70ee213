"""The command line: every flag fills the options object, is documented, and the engine and
shutdown options come out of it whole."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from actors import serve
from actors.gpu_worker import GpuWorker
from actors.options import ServeConfig
from actors.shutdown import ShutdownPlan
from model.blas import BlasInfo
from model.options import EngineOptions

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_flags_are_the_default_options(monkeypatch):
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    monkeypatch.delenv("MLX_TRIO_ADMIN_TOKEN", raising=False)
    assert serve.serve_config(serve.parse_args([])) == ServeConfig()


def test_flags_reach_their_fields():
    config = serve.serve_config(
        serve.parse_args(
            [
                "--memory-budget",
                "3",
                "--prompt-cache",
                "0.5",
                "--ssd-cache",
                "/x",
                "--ssd-demote-idle",
                "0",
                "--cors-origin",
                "https://a/,https://b",
                "--temp",
                "0.7",
            ]
        )
    )
    assert (config.memory_budget_gb, config.prompt_cache_gb, config.ssd_cache_dir, config.ssd_demote_idle_s) == (
        3.0,
        0.5,
        "/x",
        0.0,
    )
    assert config.cors_origins == ("https://a", "https://b") and config.temperature == 0.7


def test_engine_flags_make_the_engine_options():
    args = serve.parse_args(
        [
            "--prefill-chunk",
            "512",
            "--prefill-bucket",
            "16",
            "--group-bucket",
            "0",
            "--unfused-hit-prefill",
            "off",
            "--warm-decode-capacity",
            "1024",
            "--clear-cache",
            "on",
        ]
    )
    assert serve.serve_config(args).engine_options() == EngineOptions(
        prefill_chunk=512,
        prefill_bucket=16,
        group_bucket=0,
        unfused_hit_prefill=False,
        warm_decode_capacity=1024,
        clear_cache=True,
    )
    # auto (or no flag): the device decides
    auto = serve.serve_config(serve.parse_args(["--unfused-hit-prefill", "auto"])).engine_options()
    assert auto == EngineOptions() and auto.unfused_hit_prefill is None and auto.clear_cache is None
    with pytest.raises(SystemExit):
        serve.parse_args(["--clear-cache", "maybe"])


def test_the_planned_worker_gets_the_engine_options(qwen3_dir):
    config = serve.serve_config(serve.parse_args(["--model", str(qwen3_dir), "--prefill-chunk", "64"]))
    _, worker, _ = serve._load_plan(attrs.evolve(config, group_bucket=8))
    assert isinstance(worker, GpuWorker) and worker.prefill_chunk == 64
    assert worker.engine_options == EngineOptions(prefill_chunk=64, group_bucket=8)


def test_every_flag_is_documented():
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    flags = [f for action in serve.parser()._actions for f in action.option_strings if f.startswith("--")]
    flags.remove("--help")
    assert "--blas" in flags and "--group-bucket" in flags
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[ `]", text)]
    assert missing == []


def test_blas_setting_is_preloaded_before_the_server_runs(monkeypatch):
    seen: list[object] = []
    monkeypatch.setattr(
        "model.blas.preload_optimized_blas", lambda setting: seen.append(setting) or BlasInfo("x", None, "test")
    )
    monkeypatch.setattr("trio.run", lambda main, config: seen.append(config) or 0)
    assert serve.main(["--blas", "off", "--port", "0"]) == 0
    assert seen[0] == "off" and isinstance(seen[1], ServeConfig) and seen[1].port == 0


def test_the_shutdown_plan_owns_every_deadline():
    plan = ShutdownPlan.for_options(ServeConfig(shutdown_timeout=3.0))
    assert (plan.drain, plan.http_deadline, plan.durability_flush, plan.watchdog) == (3.0, 5.0, 0.0, 15.0)
    with_ssd = ShutdownPlan.for_options(ServeConfig(shutdown_timeout=3.0, ssd_cache_dir="/x"))
    assert (with_ssd.durability_flush, with_ssd.watchdog) == (3.0, 18.0)  # the flush's budget is counted
    assert attrs.evolve(plan, watchdog_slack=1.0).watchdog == 6.0
    assert (plan.flush_hooks, plan.hard_exit_after, plan.drained_http_grace) == (10.0, 2.0, 0.5)
