"""Start-up mistakes through a real `python -m actors.serve`: each is one line on stderr naming
the problem, exit 2, in under 2 s, and no traceback unless --log-level debug.

* an --ssd-cache that cannot be written, or that another server holds (unless --ssd-optional);
* a --model directory without tokenizer.json (refused before any weight loads), or with a
  malformed one;
* --port 99999;
* an api.py / cache.py / model.py (or such a package) in the working directory shadowing ours.

The mistakes that do not stop the server (a model without a chat template; --ssd-optional with
an SSD directory another server holds) are one warning each, and it serves.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cache.ssd_identity import Identity, model_fingerprint, scheme_key, tokenizer_hash
from cache.ssd_store import SsdStore
from tests.e2e.server_process import wait_until_serving

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def serve(args: list[str], *, cwd: Path = ROOT, python: tuple[str, ...] = ()) -> tuple[int, str]:
    """Exit code and stderr of a server that is expected to stop by itself."""
    done = subprocess.run(
        [sys.executable, *python, "-m", "actors.serve", *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return done.returncode, done.stderr


def check_one_line(result: tuple[int, str], *expected: str) -> str:
    """Exit 2 with one line on stderr (timings are measured, never asserted: a busy machine is slow)."""
    code, stderr = result
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert len(lines) == 1, stderr
    assert all(part in lines[0] for part in expected), stderr
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3")


def hold_ssd_dir(root: Path, model: Path) -> SsdStore:
    """Open the SSD tier's directory for `model` as another server would (its lock held)."""
    identity = Identity("other", model_fingerprint(model), scheme_key("float32"), tokenizer_hash(model))
    return SsdStore(root, identity, max_bytes=2**30).open()


def test_an_unwritable_ssd_cache_is_one_line(tmp_path, model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = check_one_line(
        serve(["--model", str(model_dir), "--ssd-cache", str(blocker / "kv"), "--port", "0"]),
        "cannot serve: --ssd-cache",
        "not a writable directory",
        "--ssd-optional",
    )
    assert "ERROR" in line


def test_the_traceback_comes_only_at_debug(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, stderr = serve(["--ssd-cache", str(blocker / "kv"), "--port", "0", "--log-level", "debug"])
    assert code == 2 and "Traceback" in stderr and "not a writable directory" in stderr


def test_an_ssd_cache_another_server_holds_is_one_line(tmp_path, model_dir):
    store = hold_ssd_dir(tmp_path / "kv", model_dir)
    try:
        # --log-level warning: the info lines of the load (the lock is per model identity, so the
        # check needs the loaded model) would be the only others.
        result = serve(
            ["--model", str(model_dir), "--ssd-cache", str(tmp_path / "kv"), "--port", "0", "--log-level", "warning"]
        )
    finally:
        store.close()
    check_one_line(result, "cannot serve: --ssd-cache", "in use by another server", "--ssd-optional")


def test_a_model_without_tokenizer_json_is_refused_before_it_loads(tmp_path, model_dir):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").unlink()
    check_one_line(serve(["--model", str(broken), "--port", "0"]), f"cannot serve: {broken}: no tokenizer.json")


def test_a_malformed_tokenizer_json_is_the_directorys_fault_too(tmp_path, model_dir):
    broken = tmp_path / "bad-tokenizer"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text("{")
    check_one_line(serve(["--model", str(broken), "--port", "0"]), "cannot serve: ", "not a valid tokenizer.json")


def test_a_port_out_of_range_is_one_line():
    check_one_line(serve(["--port", "99999"]), "argument --port", "0 to 65535")


@pytest.mark.parametrize("shadow", ["api.py", "cache.py", "model.py", "api/__init__.py"])
def test_a_module_in_the_working_directory_shadowing_ours_is_one_line(tmp_path, shadow):
    (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / shadow).write_text("raise SystemExit('imported the wrong module')\n")
    check_one_line(serve([], cwd=tmp_path), f"cannot serve: ./{shadow} shadows", "mlx-trio-server")


def test_without_the_working_directory_on_the_path_nothing_is_shadowed(tmp_path):
    """The console script's situation (`python -P`: no working directory on sys.path): the
    api.py there is never imported, so the next check is what fails."""
    (tmp_path / "api.py").write_text("raise SystemExit('imported the wrong module')\n")
    check_one_line(serve(["--port", "99999"], cwd=tmp_path, python=("-P",)), "argument --port")


def test_a_model_without_a_chat_template_and_an_optional_held_ssd_cache_serve_with_warnings(tmp_path, model_dir):
    plain = tmp_path / "no-template"
    shutil.copytree(model_dir, plain)
    config_file = plain / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert config.pop("chat_template")
    config_file.write_text(json.dumps(config))
    store = hold_ssd_dir(tmp_path / "kv", plain)
    log_path = tmp_path / "server.log"
    try:
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.serve", "--model", str(plain), "--port", "0", "--warm-up", "off"]
                + ["--ssd-cache", str(tmp_path / "kv"), "--ssd-optional"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        try:
            wait_until_serving(proc, log_path, 60)
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
    finally:
        store.close()
    log = log_path.read_text()
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    assert code == 0, log
    assert len(warnings) == 2, log
    assert "has no chat template" in warnings[0] and "chat_template.jinja" in warnings[0]
    assert "SSD cache disabled (--ssd-optional)" in warnings[1] and "in use by another server" in warnings[1]
