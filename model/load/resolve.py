"""Turn a `--model` argument into a local model directory, offline.

Accepted: a directory path, or an `org/name` id looked up in the local Hugging Face cache
(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) as
`models--org--name/snapshots/<refs/main>`. Nothing is ever downloaded.

`model_name` names a model directory the way clients know it: `org/name` for a snapshot of the
Hugging Face cache (whose directory name is a commit hash), else the directory's own name.
"""

from __future__ import annotations

import os
from pathlib import Path

from model.load.errors import ModelLoadError

_REPO_PREFIX = "models--"


def hub_cache_dir() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def resolve_model_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    looked = [str(path)]
    parts = spec.strip("/").split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~")):
        repo = hub_cache_dir() / f"{_REPO_PREFIX}{parts[0]}--{parts[1]}"
        looked.append(str(repo))
        snapshot = _main_snapshot(repo)
        if snapshot is not None:
            return snapshot
    raise ModelLoadError(
        f"model {spec!r} not found (looked in: {', '.join(looked)}); "
        "pass a local model directory or an org/name already in the Hugging Face cache "
        "(this server never downloads)"
    )


def hub_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `org/name`, or None; never the filesystem
    around it (a name a request gives must not reach an arbitrary directory)."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") or "--" in p for p in parts):
        return None
    return _main_snapshot(hub_cache_dir() / f"{_REPO_PREFIX}{parts[0]}--{parts[1]}")


def model_name(model_dir: Path) -> str:
    """`org/name` for `.../models--org--name/snapshots/<hash>`, else the directory's name."""
    snapshots = model_dir.parent
    repo = snapshots.parent.name
    if snapshots.name == "snapshots" and repo.startswith(_REPO_PREFIX) and len(repo) > len(_REPO_PREFIX):
        # The hub writes a repo id's "/" as "--" (ids cannot contain "--" themselves).
        return repo.removeprefix(_REPO_PREFIX).replace("--", "/")
    return model_dir.name


def _main_snapshot(repo: Path) -> Path | None:
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    if snapshots.is_dir():
        # No refs/main (e.g. a cache filled by hand): take the newest snapshot.
        dirs = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        if dirs:
            return dirs[-1]
    return None
