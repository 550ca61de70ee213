"""The models a pooled server can serve (actors/pool.py), by the name a request's `model` gives.

* the `--model` (the default: loaded at start, and what a request without `model` gets), under
  its served name (`--served-model-name`'s first, else its own) and the aliases that name it
  (api/model_names.py: the `--model` string, its resolved directory, `default_model`);
* every model directory under `--models-dir` (a subdirectory holding a config.json), named by
  its directory name; without `--model`, the first of them by name is the default;
* by `org/name`, every model already in the local Hugging Face cache. Nothing is downloaded.

Reads only the filesystem, never MLX: the listing is taken when asked (GET /v1/models), so a
directory copied in while the server runs is servable at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs

from model.load.resolve import hub_cache_dir, hub_snapshot, model_name, resolve_model_dir

_REPO_PREFIX = "models--"


@attrs.frozen
class Servable:
    """One servable model: the id requests and /v1/models use, and its directory."""

    id: str
    path: Path


def model_dirs(root: Path) -> list[Servable]:
    """The model directories directly under `root` (each holding a config.json), by name."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    return [Servable(child.name, child.resolve()) for child in children if (child / "config.json").is_file()]


def hub_models() -> list[str]:
    """The `org/name` of every model repository in the local Hugging Face cache."""
    try:
        repos = sorted(hub_cache_dir().iterdir())
    except OSError:
        return []
    names = []
    for repo in repos:
        parts = repo.name.removeprefix(_REPO_PREFIX).split("--")
        if repo.name.startswith(_REPO_PREFIX) and len(parts) == 2 and all(parts) and (repo / "snapshots").is_dir():
            names.append("/".join(parts))
    return names


class ModelCatalog:
    def __init__(self, default: Servable, *, aliases: Iterable[str] = (), models_dir: Path | None = None) -> None:
        self.default = default
        self.aliases = frozenset(a.rstrip("/") or a for a in aliases) - {default.id}
        self.models_dir = models_dir

    def listed(self) -> list[str]:
        """Every servable id, the default first, then --models-dir's, then the HF cache's."""
        ids = [self.default.id]
        if self.models_dir is not None:  # (the default's own directory is listed once, as the default)
            ids += [m.id for m in model_dirs(self.models_dir) if m.path != self.default.path]
        ids += hub_models()
        return list(dict.fromkeys(ids))

    def find(self, name: str) -> Servable | None:
        """The servable model `name` names, or None (never a download, never an error)."""
        name = name.rstrip("/") or name
        if name == self.default.id or name in self.aliases:
            return self.default
        if self.models_dir is not None and "/" not in name and name not in (".", ".."):
            candidate = self.models_dir / name
            try:
                if (candidate / "config.json").is_file():
                    path = candidate.resolve()  # (the default's directory is the default, whatever its name)
                    return self.default if path == self.default.path else Servable(name, path)
            except (OSError, ValueError):  # (a name no filesystem takes)
                return None
        snapshot = hub_snapshot(name)
        return None if snapshot is None else Servable(name, snapshot)


def default_model(model: str | None, served_name: str | None, models_dir: Path | None) -> Servable | None:
    """The pool's default: the `--model` (under its served name), else the first of --models-dir."""
    if model is not None:
        path = resolve_model_dir(model)
        listed = [m.id for m in (model_dirs(models_dir) if models_dir is not None else []) if m.path == path]
        return Servable(served_name or (listed[0] if listed else model_name(path)), path)
    if models_dir is not None:
        found = model_dirs(models_dir)
        if found:
            first = found[0]
            return Servable(served_name or first.id, first.path)
    return None
