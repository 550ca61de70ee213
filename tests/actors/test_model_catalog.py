"""What a model pool can serve, by the name a request gives: the default, --models-dir's
directories, the Hugging Face cache's repositories; nothing else on the filesystem."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.model_catalog import ModelCatalog, Servable, default_model
from tests.helpers.pool import write_model_dirs


def _hub_repo(cache: Path, org: str, name: str) -> Path:
    snapshot = cache / f"models--{org}--{name}" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / f"models--{org}--{name}" / "refs").mkdir()
    (cache / f"models--{org}--{name}" / "refs" / "main").write_text("abc123")
    return snapshot


def test_names_the_default_the_models_dir_and_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_model_dirs(tmp_path / "models", ["b", "a", "c"])
    (root / "notes").mkdir()  # no config.json: not a model
    hub = tmp_path / "hub"
    snapshot = _hub_repo(hub, "org", "tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    default = default_model(None, None, root)
    assert default == Servable("a", (root / "a").resolve())  # without --model: the first by name
    catalog = ModelCatalog(default, aliases=["default_model", "my-alias"], models_dir=root)
    assert catalog.listed() == ["a", "b", "c", "org/tiny"]
    assert catalog.find("c") == Servable("c", (root / "c").resolve())
    assert catalog.find("default_model") == catalog.find("my-alias") == default
    assert catalog.find("org/tiny") == Servable("org/tiny", snapshot)
    for name in ("notes", "nope", "../models/a", "org/other", "..", "a/../b", "/etc", "x\0y"):
        assert catalog.find(name) is None, name


def test_the_default_model_is_named_as_its_models_dir_entry(tmp_path: Path) -> None:
    root = write_model_dirs(tmp_path / "models", ["a", "b"])
    link = tmp_path / "elsewhere"
    link.symlink_to(root / "b", target_is_directory=True)
    default = default_model(str(link), None, root)
    assert default is not None and default.id == "b"
    catalog = ModelCatalog(default, models_dir=root)
    assert catalog.listed() == ["b", "a"] and catalog.find("b") is default
    assert default_model(str(link), "public", root) == Servable("public", (root / "b").resolve())
