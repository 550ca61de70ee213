"""The command line: every flag fills the options object, is documented, and the engine and
shutdown options come out of it whole."""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import attrs
import pytest

from actors import serve
from actors.gpu_worker import GpuWorker
from actors.options import options as serve_options
from actors.options import parse_options, parser
from actors.shutdown import ShutdownPlan
from model.load.blas import BlasInfo
from model.options import EngineOptions, ServerOptions, reference
from model.options.flags import field_groups
from tests.helpers.options import parsed

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_flags_are_the_default_options(monkeypatch):
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    monkeypatch.delenv("MLX_TRIO_ADMIN_TOKEN", raising=False)
    assert parse_options([]) == serve_options()


def test_flags_reach_their_fields():
    config = parsed(
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
    assert (config.memory_budget_gb, config.prompt_cache_gb, config.ssd_cache_dir, config.ssd_demote_idle_s) == (
        3.0,
        0.5,
        "/x",
        0.0,
    )
    assert config.cors_origins == ("https://a", "https://b") and config.temperature == 0.7


def test_engine_flags_make_the_engine_options():
    args = parse_options(
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
    assert args.engine == EngineOptions(
        prefill_chunk=512,
        prefill_bucket=16,
        group_bucket=0,
        unfused_hit_prefill=False,
        warm_decode_capacity=1024,
        clear_cache=True,
    )
    # auto (or no flag): the device decides
    auto = parse_options(["--unfused-hit-prefill", "auto"]).engine
    assert auto == EngineOptions() and auto.unfused_hit_prefill is None and auto.clear_cache is None
    with pytest.raises(SystemExit):
        parsed(["--clear-cache", "maybe"])


def test_the_planned_worker_gets_the_engine_options(qwen3_dir):
    config = parse_options(["--model", str(qwen3_dir), "--prefill-chunk", "64"])
    _, worker, _ = serve._load_plan(attrs.evolve(config, engine=attrs.evolve(config.engine, group_bucket=8)))
    assert isinstance(worker, GpuWorker) and worker.prefill_chunk == 64
    assert worker.options.engine == EngineOptions(prefill_chunk=64, group_bucket=8)


def test_the_flag_reference_in_the_docs_is_current():
    """docs/operations.md's generated section is what the options say now (after adding or
    changing an option: `python -m model.options.reference docs/operations.md`)."""
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert reference.rewrite(text) == text


def test_every_flag_is_documented():
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    flags = [f for action in parser()._actions for f in action.option_strings if f.startswith("--")]
    flags.remove("--help")
    assert "--blas" in flags and "--group-bucket" in flags
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[ `]", text)]
    assert missing == []


def test_blas_setting_is_preloaded_before_the_server_runs(monkeypatch):
    seen: list[object] = []
    monkeypatch.setattr(
        "model.load.blas.preload_optimized_blas", lambda setting: seen.append(setting) or BlasInfo("x", None, "test")
    )
    monkeypatch.setattr("trio.run", lambda main, config: seen.append(config) or 0)
    assert serve.main(["--blas", "off", "--port", "0"]) == 0
    assert seen[0] == "off" and isinstance(seen[1], ServerOptions) and seen[1].http.port == 0


def test_the_shutdown_plan_owns_every_deadline():
    plan = ShutdownPlan.for_options(serve_options(shutdown_timeout=3.0))
    assert (plan.drain, plan.http_deadline, plan.durability_flush, plan.watchdog) == (3.0, 5.0, 0.0, 15.0)
    with_ssd = ShutdownPlan.for_options(serve_options(shutdown_timeout=3.0, ssd_cache_dir="/x"))
    assert (with_ssd.durability_flush, with_ssd.watchdog) == (3.0, 18.0)  # the flush's budget is counted
    assert attrs.evolve(plan, watchdog_slack=1.0).watchdog == 6.0
    assert (plan.flush_hooks, plan.hard_exit_after, plan.drained_http_grace) == (10.0, 2.0, 0.5)


# --- one home for every option -----------------------------------------------------------------

RECORDED_FLAGS = Path(__file__).with_name("recorded_flags.json")


def _flag_rows(p: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        default = list(action.default) if isinstance(action.default, (list, tuple)) else action.default
        choices = list(action.choices) if action.choices else None
        rows.append(
            {"flags": action.option_strings, "default": default, "choices": choices, "nargs": action.nargs}
            | {"metavar": action.metavar}
        )
    return sorted(rows, key=lambda row: row["flags"])


def test_the_generated_command_line_keeps_every_recorded_flag(monkeypatch):
    """Every flag --help listed when the parser became generated (tests/actors/recorded_flags.json)
    is still there with the same default, choices and metavar; options added since come on top."""
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    monkeypatch.delenv("MLX_TRIO_ADMIN_TOKEN", raising=False)
    now = {tuple(row["flags"]): row for row in _flag_rows(parser())}
    recorded = json.loads(RECORDED_FLAGS.read_text())
    assert [row for row in recorded if now.get(tuple(row["flags"])) != row] == []


def test_help_groups_flags_by_topic_and_states_every_default(monkeypatch, capsys):
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_options(["--help"])
    text = capsys.readouterr().out
    for title in ("HTTP:", "Access:", "Admission:", "Scheduling:", "Prompt cache:", "KV cache", "Engine:"):
        assert f"\n{title}" in text, title
    for action in parser()._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert "default" in (action.help or ""), action.option_strings


def test_each_default_is_stated_once_and_the_parser_agrees(monkeypatch):
    """The parser's default for every flag is its field's, and the options parsed from no flags
    are the options built from no fields."""
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    monkeypatch.delenv("MLX_TRIO_ADMIN_TOKEN", raising=False)
    owners = field_groups(ServerOptions)
    p = parser()
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        field = attrs.fields_dict(owners[action.dest])[action.dest]
        expected = list(field.default) if isinstance(field.default, tuple) else field.default
        assert action.default == expected, action.option_strings
    assert parse_options([]) == ServerOptions() == serve_options()


def _option_defaults() -> dict[str, object]:
    """Each option field's name and its default, for the defaults worth recognising (not None,
    False, 0 or empty: those mean "off" everywhere)."""
    out = {}
    for name, owner in field_groups(ServerOptions).items():
        default = attrs.fields_dict(owner)[name].default
        if default not in (None, False, True, 0, "", ()) and not isinstance(default, tuple):
            out[name] = default
    return out


# Consumers' names for options (a cache's `retention_share` is --cache-retention-share).
CONSUMER_NAMES = {"retention_share": "cache_retention_share", "chunk": "prefill_chunk", "max_queue": "max_queue"}


def test_no_consumer_states_an_options_default_of_its_own():
    """No parameter or attrs field outside model/options/ named as an option (or as a consumer
    calls it, CONSUMER_NAMES) gives that option's default as a literal: consumers take their
    group, or `default_of` it."""
    defaults = _option_defaults()
    found = []
    for package in ("actors", "api", "cache", "model"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent.name == "options" and path.parent.parent.name == "model":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for name, value in _literal_defaults(tree):
                for option, default in defaults.items():
                    if option in (name, CONSUMER_NAMES.get(name)) and value == default:
                        found.append(f"{path.relative_to(ROOT)}: {name}={value!r} restates --{option}")
    assert found == []


def _literal_defaults(tree: ast.AST):
    """(name, literal value) of every keyword default and annotated class-field default."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if isinstance(default, ast.Constant):
                    yield arg.arg, default.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(node.value, ast.Constant):
                yield node.target.id, node.value.value
