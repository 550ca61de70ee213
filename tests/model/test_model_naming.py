"""What a loaded model is called: `org/name` for a Hugging Face cache snapshot (never its hash),
a local directory's own name, the demo's name; `--served-model-name` overrides it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from actors import serve
from actors.gpu_worker import GpuWorker
from actors.options import options as serve_options
from actors.options import parse_options
from model.load.loader import load_model
from model.load.resolve import model_name, resolve_model_dir
from tests.helpers.options import parsed


def fake_hub(tmp_path: Path, source: Path, repo: str = "models--acme--tiny-chat", commit: str = "0f1e2d3c") -> Path:
    """The hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    root = tmp_path / "hub" / repo
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(source, root / "snapshots" / commit)
    return tmp_path / "hub"


def test_a_hub_snapshot_is_named_org_slash_name(qwen3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_hub(tmp_path, qwen3_dir)))
    snapshot = resolve_model_dir("acme/tiny-chat")
    assert snapshot.name == "0f1e2d3c"
    assert model_name(snapshot) == "acme/tiny-chat"
    loaded = load_model("acme/tiny-chat")
    assert loaded.name == "acme/tiny-chat" and loaded.path == snapshot
    # the snapshot directory passed as a path is the same model, with the same name
    assert load_model(str(snapshot)).name == "acme/tiny-chat"
    assert load_model("acme/tiny-chat", name="public").name == "public"


def test_other_directories_keep_their_own_name(qwen3_dir, tmp_path):
    assert load_model(qwen3_dir).name == qwen3_dir.name
    assert model_name(tmp_path / "my-model") == "my-model"
    # only the exact hub layout is renamed
    assert model_name(tmp_path / "models--acme--x" / "other" / "abc") == "abc"
    assert model_name(tmp_path / "models--" / "snapshots" / "abc") == "abc"
    assert model_name(tmp_path / "models--gpt2" / "snapshots" / "abc") == "gpt2"  # an id without an org


def test_the_demo_keeps_its_name(tmp_path):
    from model.load.demo import ensure_demo_model

    demo = ensure_demo_model(tmp_path)
    assert model_name(demo) == demo.name


def test_served_model_name_flag():
    config = parsed(["--served-model-name", "public", "alias"])
    assert config.served_model_name == ("public", "alias")
    assert parsed([]).served_model_name == ()
    assert serve_options(served_model_name=["a"]).model.served_model_name == ("a",)  # hashable, as the rest
    for bad in (["--served-model-name"], ["--served-model-name", ""]):
        with pytest.raises(SystemExit):
            parsed(bad)


def test_the_first_served_name_names_the_loaded_model(qwen3_dir):
    config = parse_options(["--model", str(qwen3_dir), "--served-model-name", "public", "b"])
    _, worker, _ = serve._load_plan(config)
    assert isinstance(worker, GpuWorker) and worker.name == "public"  # ModelInfo.name: the log line's name
    _, plain, _ = serve._load_plan(parse_options(["--model", str(qwen3_dir)]))
    assert isinstance(plain, GpuWorker) and plain.name is None  # the loader names it
