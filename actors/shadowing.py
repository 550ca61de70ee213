"""Whether Python would import one of the server's own packages from somewhere else.

`python -m actors.serve` puts the working directory first on the import path, so an `api.py`,
`cache.py` or `model.py` there (or a package directory of that name) would be imported in place
of ours and start-up would crash deep inside with a traceback. The entry point asks
`shadowing_problem()` before it imports anything of ours besides this module, and stops with
one line instead. The `mlx-trio-server` console script does not put the working directory on
the path, so there it only catches a shadow on PYTHONPATH. Stdlib only: nothing of ours may be
imported before the check.

An `actors.py` in the working directory cannot be caught here: Python fails to find
`actors.serve` before any of our code runs (the console script avoids that too).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path

PACKAGES = ("actors", "api", "cache", "model")
ROOT = Path(__file__).resolve().parent.parent  # the directory holding our packages


def shadowing_problem(root: Path = ROOT) -> str | None:
    """One line naming the first package of ours that would be imported from elsewhere, or None."""
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:  # a broken module of that name (or a bad spec)
            return f"cannot import this server's `{name}` package: {exc}"
        if spec is None:
            return f"cannot find this server's `{name}` package: is mlx-trio-server installed?"
        origin = spec.origin
        if origin is not None and Path(origin).resolve() == (root / name / "__init__.py").resolve():
            continue
        where = _shown(origin or _locations(spec) or name)
        return (
            f"{where} shadows this server's `{name}` package (Python imports it from the working directory "
            "or PYTHONPATH first): rename it, start the server from another directory, or run the "
            "`mlx-trio-server` command, which does not import from the working directory"
        )
    return None


def _locations(spec: importlib.machinery.ModuleSpec) -> str | None:
    """A namespace package's directories (it has no origin file)."""
    if not spec.submodule_search_locations:
        return None
    return ", ".join(str(p) for p in spec.submodule_search_locations)


def _shown(path: str) -> str:
    """`path` relative to the working directory when it is inside it (./api.py), else as is."""
    try:
        relative = Path(path).resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        return path
    return f".{os.sep}{relative}"
