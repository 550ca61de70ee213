"""The start-up checks below the subprocess tests (tests/e2e/test_startup_mistakes.py): `~` in
every path flag, the port's range, the pre-flight's SSD and model-directory rules, and what a
shadowed package looks like to `shadowing_problem`."""

from __future__ import annotations

import json
import logging
import shutil
import socket
from pathlib import Path

import pytest

from actors import serve
from actors.options import options as serve_options
from actors.options import validate
from actors.preflight import preflight, ssd_dir_problem, unix_socket_problem
from actors.shadowing import shadowing_problem
from actors.startup import StartupFailed
from tests.helpers.options import parsed


def test_every_path_flag_expands_a_leading_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    args = parsed(
        ["--model", "~/m", "--ssd-cache", "~/kv", "--adapter", "a=~/ad", "--adapters-dir", "~/ads"]
        + ["--draft-model", "~/d", "--blas", "~/libblas.so"]
    )
    home = str(tmp_path)
    assert (args.model, args.ssd_cache_dir, args.adapters, args.adapters_dir, args.draft_model, args.blas) == (
        f"{home}/m",
        f"{home}/kv",
        (("a", f"{home}/ad"),),
        f"{home}/ads",
        f"{home}/d",
        f"{home}/libblas.so",
    )
    # An org/name, auto and a ~ that does not lead stay as they are.
    plain = parsed(["--model", "org/name", "--ssd-cache", "a/~b"])
    assert (plain.model, plain.ssd_cache_dir, plain.blas) == ("org/name", "a/~b", "auto")


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_port_out_of_range_is_one_usage_line(port, capsys):
    with pytest.raises(SystemExit) as exited:
        parsed(["--port", port])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and "--port" in err


def test_port_bounds_are_accepted():
    assert [parsed(["--port", p]).port for p in ("0", "1", "65535")] == [0, 1, 65535]


def test_an_unusable_ssd_directory_fails_unless_optional(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = serve_options(ssd_cache_dir=str(blocker / "kv"))
    with pytest.raises(StartupFailed) as failed:
        preflight(config)
    assert failed.value.usage and "--ssd-optional" in failed.value.message
    with caplog.at_level(logging.WARNING):
        optional = preflight(serve_options(ssd_cache_dir=str(blocker / "kv"), ssd_optional=True))
    assert optional.caches.ssd_cache_dir is None and "SSD cache disabled (--ssd-optional)" in caplog.text


def test_a_usable_ssd_directory_is_created_and_left_clean(tmp_path):
    root = tmp_path / "new" / "kv"
    assert ssd_dir_problem(root) is None
    assert root.is_dir() and list(root.iterdir()) == []  # the probe file is gone
    assert preflight(serve_options(ssd_cache_dir=str(root))).caches.ssd_cache_dir == str(root)


def test_ssd_cache_needs_the_ram_tier():
    assert "requires the RAM prompt cache" in validate(serve_options(ssd_cache_dir="/unused", prompt_cache_gb=0))


def test_model_directory_rules(tmp_path, qwen3_dir, caplog):
    assert preflight(serve_options(model=str(qwen3_dir))).model.model == str(qwen3_dir)
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(StartupFailed, match="no tokenizer.json"):
        preflight(serve_options(model=str(broken)))
    config = json.loads((qwen3_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "nonsense"}))
    with pytest.raises(StartupFailed, match="unsupported model_type 'nonsense'"):  # config first
        preflight(serve_options(model=str(broken)))
    with pytest.raises(StartupFailed, match="not found"):
        preflight(serve_options(model=str(tmp_path / "absent")))


def test_a_missing_chat_template_is_a_warning(tmp_path, qwen3_dir, caplog):
    plain = tmp_path / "plain"
    shutil.copytree(qwen3_dir, plain)
    file = plain / "tokenizer_config.json"
    config = json.loads(file.read_text())

    def warned(**changes: object) -> bool:
        file.write_text(json.dumps({**{k: v for k, v in config.items() if k != "chat_template"}, **changes}))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            preflight(serve_options(model=str(plain)))
        return "has no chat template" in caplog.text and "/v1/completions works" in caplog.text

    assert not warned(chat_template=config["chat_template"])
    assert warned()
    assert warned(chat_template=[{"name": "default"}])  # a named entry without its template
    assert not warned(chat_template=[{"name": "default", "template": "x"}])
    (plain / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert not warned()


def test_a_tokenizer_that_does_not_load_fails_before_the_weights(tmp_path, qwen3_dir):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    (broken / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(StartupFailed, match="chat template syntax error"):
        preflight(serve_options(model=str(broken)))
    (broken / "tokenizer.json").write_text("{")
    with pytest.raises(StartupFailed, match="not a valid tokenizer.json"):
        preflight(serve_options(model=str(broken)))


def test_shadowing_names_the_module_in_the_way(tmp_path, monkeypatch):
    assert shadowing_problem() is None  # the test run's own packages
    fake_root = tmp_path / "elsewhere"  # as if our packages lived there: the real ones shadow them
    problem = shadowing_problem(fake_root)
    assert problem is not None and "shadows this server's `actors` package" in problem


def test_the_demo_model_is_served_under_the_name_it_is_logged_as(monkeypatch, tmp_path, caplog):
    from actors.gpu_worker import GpuWorker
    from model.load.demo import DEMO_MODEL_NAME

    monkeypatch.setenv("MLX_TRIO_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO):
        _, worker, _ = serve._load_plan(serve_options())
    assert isinstance(worker, GpuWorker) and worker.name == DEMO_MODEL_NAME == "mlx-trio-demo"
    assert f"served as {DEMO_MODEL_NAME}" in caplog.text
    _, named, _ = serve._load_plan(serve_options(served_model_name=("public",)))
    assert isinstance(named, GpuWorker) and named.name == "public"


def test_the_console_script_runs_the_entry_point():
    import importlib
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["mlx-trio-server"].partition(":")
    assert getattr(importlib.import_module(module), function) is serve.main


def test_unix_socket_path_rules(tmp_path):
    assert unix_socket_problem(tmp_path / "fresh.sock") is None
    assert "does not exist" in (unix_socket_problem(tmp_path / "nowhere" / "s.sock") or "")
    assert "too long" in (unix_socket_problem(tmp_path / ("x" * 120)) or "")
    (tmp_path / "file").write_text("not a socket")
    assert "not a socket" in (unix_socket_problem(tmp_path / "file") or "")
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # closed without listening: a dead server's leftover
    assert unix_socket_problem(stale) is None
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(live))
        s.listen()
        assert "another server is listening" in (unix_socket_problem(live) or "")
        with pytest.raises(StartupFailed) as failed:
            preflight(serve_options(unix=str(live)))
        assert failed.value.usage


def test_isolate_refuses_tensor_parallelism():
    assert "--isolate" in (validate(serve_options(isolate=True, tensor_parallel=2)) or "")
    assert validate(serve_options(isolate=True)) is None
