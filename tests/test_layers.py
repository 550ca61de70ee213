"""The shape of the house, checked from the source: one-way layers, no import cycles, small modules.

Layers import one way: model <- cache <- actors <- api. Only the composition root
(actors/serve.py, actors/root.py) may reach up into api. Every import counts: a function-level
one, and one under `if TYPE_CHECKING:` (a cycle of types is still a tangle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "cache", "actors", "api")
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}
COMPOSITION_ROOT = {"actors.serve", "actors.root"}
MAX_MODULE_LINES = 500
MAX_FAMILY_LINES = 250
# A module past the cap because its one job is long, with why; never split to meet a count.
LONG_MODULES = {
    "model.options.groups": "every option of the server, one declaration each (flag, default, help)",
}
MAX_LONG_MODULE_LINES = 1000
# The only environment variables shipped code reads: secrets and deployment paths (docs/operations.md),
# and OpenTelemetry's standard collector setting, a deployment's (api/observability/tracing.py).
DEPLOYMENT_VARIABLES = {"MLX_TRIO_API_KEY", "MLX_TRIO_ADMIN_TOKEN", "MLX_TRIO_CACHE", "OTEL_EXPORTER_OTLP_ENDPOINT"}
# MLX's ring backend reads these itself: --tensor-parallel sets them for its follower processes and
# its own rank (actors/tp/leader.py); no code of ours reads them.
DEPLOYMENT_VARIABLES |= {"MLX_RANK", "MLX_HOSTFILE"}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The project modules `module` imports (a `from pkg import name` names pkg.name when that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    out = set()
    for name in found:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


GRAPH = {module: _imported(module, path) for module, path in MODULES.items()}


def test_layers_import_one_way() -> None:
    upward = []
    for module, imports in GRAPH.items():
        layer = LAYER[module.split(".")[0]]
        for target in sorted(imports):
            if LAYER[target.split(".")[0]] > layer and module not in COMPOSITION_ROOT:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components over the module graph.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            connect(module)
    assert cycles == []


def test_the_checks_see_real_imports() -> None:
    """Guards the guard: the parser finds imports known to exist, so an empty result above means something."""
    assert "model.kv.cache" in GRAPH["model.engine.engine"]
    assert "actors.messages" in GRAPH["actors.scheduler"]
    assert any(target.startswith("api.") for target in GRAPH["actors.root"])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module: str) -> None:
    path = MODULES[module]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    limit = MAX_FAMILY_LINES if module.startswith("model.families.") else MAX_MODULE_LINES
    if module in LONG_MODULES:
        limit = MAX_LONG_MODULE_LINES
    assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines (limit {limit})"


def test_shipped_code_reads_only_deployment_variables() -> None:
    names = set()
    for path in MODULES.values():
        names |= set(re.findall(r"(?:MLX|OTEL)_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert names <= DEPLOYMENT_VARIABLES, sorted(names - DEPLOYMENT_VARIABLES)


# The cache kinds model/kv/ defines: code outside it asks them through the protocol (model/kv/cache.py).
CACHE_CLASSES = {
    "KVCache",
    "BatchKVCache",
    "QuantizedKVCache",
    "QuantizedBatchKVCache",
    "RotatingKVCache",
    "BatchRotatingKVCache",
    "StateCache",
    "BatchStateCache",
    "MixedBatchKVCache",
    "PagedBatchKVCache",
}
# Families are recognised by what they declare (`LanguageModel.capabilities`), not by class.
MODEL_CLASSES = {"DecoderModel"}


def _class_tests(tree: ast.AST) -> set[str]:
    """Names tested as classes: in isinstance/issubclass, or compared with `type(x)`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                found |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                found |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides):
                found |= {n.id for s in sides for n in ast.walk(s) if isinstance(n, ast.Name)}
    return found


def test_no_code_outside_model_kv_tests_a_caches_class_or_a_familys() -> None:
    offenders = []
    for module, path in MODULES.items():
        tested = _class_tests(ast.parse(path.read_text(encoding="utf-8")))
        kinds = tested & CACHE_CLASSES if not module.startswith("model.kv") else set()
        families = tested & MODEL_CLASSES
        if kinds or families:
            offenders.append(f"{module}: {sorted(kinds | families)}")
    assert offenders == []


def test_the_class_test_finder_sees_class_tests() -> None:
    """Guards the guard: each form is found."""
    code = "isinstance(c, KVCache)\nisinstance(c, (StateCache, kv.RotatingKVCache))\ntype(c) is BatchKVCache\n"
    assert _class_tests(ast.parse(code)) >= {"KVCache", "StateCache", "RotatingKVCache", "BatchKVCache"}
