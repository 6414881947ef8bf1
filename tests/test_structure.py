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
        graph[name] = {
            parent
            for target in graph[name]
            for parent in _with_parents(target)
            if not (name + ".").startswith(parent + ".") or parent == target
        } - {name}
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
                return path[path.index(target) :] + [target]
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


@pytest.mark.parametrize(
    "module",
    [
        "dtstudy.checks",
        "dtstudy.config.study_config",
        "dtstudy.data.checks",
        "dtstudy.launch.launcher",
        "dtstudy.launch.job",
        "dtstudy.launch.pool.client",
        "dtstudy.runspec",
        "dtstudy.strategies.specs",
        "dtstudy.projection.budget",
        "dtstudy.__main__",
    ],
)
def test_light_modules_do_not_import_torch_or_mlflow(module):
    code = (
        f"import sys, json; import {module}; "
        "print(json.dumps(sorted(m for m in ('torch', 'mlflow', 'torchvision') if m in sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [], f"{module} imports {result.stdout.strip()}"


def test_each_strategy_lives_in_one_folder_its_spec_beside_its_class():
    """One place per strategy: a family's folder holds the spec (torch-free) and the class of
    each of its strategies, and each spec module stays light."""
    from dtstudy.strategies.registry import STRATEGIES
    from dtstudy.strategies.specs import SPECS

    folders = {}
    for name, spec in SPECS.items():
        spec_folder, spec_module = spec.__module__.rsplit(".", 1)
        class_folder, class_module = STRATEGIES[name].__module__.rsplit(".", 1)
        assert (spec_module, class_module) == ("spec", "strategy"), (name, spec.__module__, STRATEGIES[name].__module__)
        assert spec_folder == class_folder, f"{name}: spec in {spec_folder}, class in {class_folder}"
        folders[spec.__module__] = spec_folder
    assert len(set(folders.values())) == 7  # allreduce, compressed, hybrid, parameter_server, local, gossip, reference
    code = (
        f"import sys; import {', '.join(sorted(folders))}; "
        "print(sorted(m for m in ('torch', 'mlflow', 'torchvision') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
    )
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.slow
def test_a_torch_importing_module_is_seen_by_the_light_import_check():
    """The check above can fail: the training loop's module imports torch."""
    code = "import sys; import dtstudy.training.loop; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
    )
    assert result.stdout.strip() == "True", result.stderr


def strategy_name_keys(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every dict display or comprehension in `path` keyed by a strategy name literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        keys = node.keys if isinstance(node, ast.Dict) else [node.key] if isinstance(node, ast.DictComp) else []
        found += [(node.lineno, key.value) for key in keys if isinstance(key, ast.Constant) and key.value in names]
    return found


#: where a strategy's knowledge lives: its spec (knobs, checks, performance model) and the registry
STRATEGY_PLACES = {"dtstudy.strategies.specs", "dtstudy.strategies.registry"}
#: the communication benchmark's results name the all-reduce *collective* it times (not the strategy)
COLLECTIVE_KEYS = {"dtstudy.projection.commbench": {"allreduce"}}


def test_no_strategy_name_is_a_dict_key_outside_the_specs_and_the_registry(tmp_path):
    from dtstudy.strategies.specs import SPECS

    names = set(SPECS)
    offenders = {
        module: keys
        for module, path in MODULES.items()
        if module not in STRATEGY_PLACES
        and (keys := [k for k in strategy_name_keys(path, names) if k[1] not in COLLECTIVE_KEYS.get(module, ())])
    }
    assert not offenders, f"name-keyed strategy tables outside the specs: {offenders}"
    # the check can fail: a perfmodel-style table keyed by name is found
    table = tmp_path / "table.py"
    table.write_text('PASSES = {"allreduce_fp16": 3.0, **{n: 1 for n in ()}}\nJITTER = {"gossip": lambda n: n}\n')
    assert strategy_name_keys(table, names) == [(1, "allreduce_fp16"), (2, "gossip")]


def test_at_most_eight_modules_at_the_top_of_the_package():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 8, f"the package's top level should show its folders, not {len(top)} modules: {top}"


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's top-level folders and modules."""

    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    folders: dict[str, set[str]] = {}
    for source, targets in graph.items():
        folders.setdefault(top(source), set()).update(
            top(t) for t in targets if t != "dtstudy" and top(t) != top(source)
        )
    return folders


def test_the_folders_import_one_way():
    """The layering reads one way: no two folders import each other, however indirectly."""
    folders = folder_graph(import_graph())
    assert folders["strategies"] and "config" in folders["strategies"], "no folder imports read: vacuous"
    assert find_cycle(folders) is None, f"folders import each other: {' -> '.join(find_cycle(folders))}"
    # the check can fail: a module of one folder importing a module of another that imports it back
    assert find_cycle(folder_graph({"dtstudy.a.x": {"dtstudy.b.y"}, "dtstudy.b.z": {"dtstudy.a.w"}})) is not None
