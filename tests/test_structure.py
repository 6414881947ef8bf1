"""The package's structure: no import cycles (function-level imports included), a one-line
docstring per module, and the modules that must stay light (the Snakefile's parse-time config
check, the launcher that waits on a login node, the pool's clients) never import torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "workflow" / "dtstudy"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str | None = None) -> set[str]:
    """The package modules `path` (module `name`) imports anywhere in it (top level, functions, methods)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dtstudy")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("dtstudy"):
                continue
            found.add(target)
            for alias in node.names:  # `from . import data` imports the module dtstudy.data
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
    return {module for module in found if module in MODULES and module != name}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    # importing a submodule runs its packages' __init__ first (unless the importer is inside them)
    for name in graph:
        graph[name] = {parent for target in graph[name] for parent in _with_parents(target)
                       if not (name + ".").startswith(parent + ".") or parent == target} - {name}
    return graph


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .config import ConfigError\n")
    assert imports_of(source, "dtstudy.m") == {"dtstudy.config"}
    source.write_text("def f():\n    from .. import errors\n")
    assert imports_of(source, "dtstudy.strategies.m") == {"dtstudy", "dtstudy.errors"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert graph["dtstudy.config.study_config"], "the graph reads no imports: the test would pass for any code"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_module_says_what_it_owns_in_its_first_line():
    for name, path in MODULES.items():
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and docstring.splitlines()[0].strip(), f"{name} has no docstring"


@pytest.mark.parametrize("module", ["dtstudy.checks", "dtstudy.config.study_config", "dtstudy.launch.launcher",
                                    "dtstudy.launch.job", "dtstudy.launch.pool", "dtstudy.runspec",
                                    "dtstudy.strategies.specs", "dtstudy.__main__"])
def test_light_modules_do_not_import_torch_or_mlflow(module):
    code = (f"import sys, json; import {module}; "
            "print(json.dumps(sorted(m for m in ('torch', 'mlflow', 'torchvision') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [], f"{module} imports {result.stdout.strip()}"


def test_a_torch_importing_module_is_seen_by_the_light_import_check():
    """The check above can fail: the training loop's module imports torch."""
    code = "import sys; import dtstudy.training.loop; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.stdout.strip() == "True", result.stderr
