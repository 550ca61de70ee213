"""A fresh `pip install -e '.[test]'` runs every test: what a test `importorskip`s is declared."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


# Installed by .ci/run with --no-deps instead: its declared dependencies (opencv, datasets, an
# audio stack, web servers) are far heavier than the parity checks it serves.
NO_DEPS_ORACLES = {"mlx-vlm"}


def test_every_importorskip_module_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"]) | _names(project["optional-dependencies"]["test"])
    skipped = {
        name.split(".")[0].lower().replace("_", "-")
        for path in (ROOT / "tests").rglob("*.py")
        for name in re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text())
    }
    assert skipped  # the scan found the optional imports
    assert skipped <= declared | NO_DEPS_ORACLES, f"tests skip without {sorted(skipped - declared)}: add them to [test]"
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(f'--no-deps "{name}' in ci for name in NO_DEPS_ORACLES)  # CI installs each
