"""Bad model directories give one clear error line; --model resolves offline."""

from __future__ import annotations

import json
import shutil

import pytest

from model.load.errors import ModelLoadError
from model.load.loader import load_model
from model.load.resolve import resolve_model_dir


def copy_of(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def one_line_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_config(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    (d / "config.json").unlink()
    assert "missing config.json" in one_line_error(d)


def test_missing_weights(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    for f in d.glob("*.safetensors"):
        f.unlink()
    assert "no model*.safetensors" in one_line_error(d)


def test_unknown_model_type_lists_supported(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = "mamba9"
    (d / "config.json").write_text(json.dumps(config))
    message = one_line_error(d)
    assert "unsupported model_type 'mamba9'" in message
    assert all(t in message for t in ("llama", "mistral", "qwen2", "qwen3"))


def test_shape_mismatch(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))
    message = one_line_error(d)
    assert "weights do not match config.json" in message and "shape" in message


def test_corrupt_safetensors(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    for f in d.glob("*.safetensors"):
        f.write_bytes(b"\x00garbage")
    assert "cannot read safetensors" in one_line_error(d)


def test_missing_shard_named_in_index(tiny_model_factory, tmp_path):
    d = copy_of(tiny_model_factory("llama", shards=3), tmp_path)
    next(iter(sorted(d.glob("model-*.safetensors")))).unlink()
    assert "shard index names missing files" in one_line_error(d)


def test_resolve_from_hf_cache_offline(qwen3_dir, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    shutil.copytree(qwen3_dir, repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("acme/tiny") == repo / "snapshots" / "abc123"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_dir("acme/tiny") == repo / "snapshots" / "abc123"


def test_resolve_miss_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        resolve_model_dir("acme/missing")
    assert str(tmp_path / "models--acme--missing") in str(info.value)
    assert "never downloads" in str(info.value)
