"""The strategies' registry and its layering: each strategy's name typed once (its spec), the
registry and the specs' table derived from the specs, the schema naming the same strategies, and
no module of dtstudy.strategies importing one on a floor above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_structure import MODULES, PACKAGE, imports_of

STRATEGIES_DIR = PACKAGE / "strategies"
STRATEGIES_PACKAGE = "dtstudy.strategies"

#: the floors of dtstudy.strategies, from the ground up. A module may import modules of its
#: own floor or below (a family's may import another family's: compressed extends allreduce;
#: the package's cycle check keeps those one way), never above.
#: 0: the interfaces (`spec`: a strategy's spec, torch-free; `base`: its class) and the package itself;
#: 1: the families, `strategies/<family>/` (specs, classes and their helpers);
#: 2: the tables that collect them: `specs` (torch-free) and `registry`.
GROUND = {STRATEGIES_PACKAGE, f"{STRATEGIES_PACKAGE}.spec", f"{STRATEGIES_PACKAGE}.base"}
TOP = {f"{STRATEGIES_PACKAGE}.specs", f"{STRATEGIES_PACKAGE}.registry"}


def floor(module: str) -> int:
    """The floor of a module of dtstudy.strategies (see above)."""
    if module in GROUND:
        return 0
    if module in TOP:
        return 2
    if module.startswith(STRATEGIES_PACKAGE + ".") and (STRATEGIES_DIR / module.split(".")[2]).is_dir():
        return 1  # dtstudy.strategies.<family>[.<module>]
    raise ValueError(f"{module} is on no floor of {STRATEGIES_PACKAGE}: give it one in this test")


def upward_imports(modules: dict[str, Path]) -> list[str]:
    """'importer -> imported' for every import, anywhere in a module (functions too), of a
    strategies module on a floor above the importer's."""
    found = []
    for name, path in sorted(modules.items()):
        for target in sorted(imports_of(path, name)):
            if target.startswith(STRATEGIES_PACKAGE + ".") and floor(target) > floor(name):
                found.append(f"{name} -> {target}")
    return found


def strategies_modules() -> dict[str, Path]:
    return {
        name: path
        for name, path in MODULES.items()
        if name == STRATEGIES_PACKAGE or name.startswith(STRATEGIES_PACKAGE + ".")
    }


def test_no_strategies_module_imports_one_above_it():
    modules = strategies_modules()
    assert {floor(name) for name in modules} == {0, 1, 2}, "the floors hold no modules: the check reads nothing"
    imports = {name: imports_of(path, name) for name, path in modules.items()}
    assert f"{STRATEGIES_PACKAGE}.base" in imports[f"{STRATEGIES_PACKAGE}.allreduce.strategy"], "no imports read"
    assert upward_imports(modules) == []


@pytest.mark.parametrize(
    "importer, line, expected",
    [
        # base.py reaching up for the specs' table, as it did to find its spec by name
        ("base", "from dtstudy.strategies.specs import SPECS", "dtstudy.strategies.base -> dtstudy.strategies.specs"),
        # the 1-bit codec taking its quantizers from the specs' table, as it did
        (
            "compressed/onebit_codec",
            "def f():\n    from dtstudy.strategies.specs import SPECS",
            "dtstudy.strategies.compressed.onebit_codec -> dtstudy.strategies.specs",
        ),
        # a family's class looking itself up in the registry, by a relative import
        (
            "reference/strategy",
            "from .. import registry",
            "dtstudy.strategies.reference.strategy -> dtstudy.strategies.registry",
        ),
        # the spec interface importing a family
        (
            "spec",
            "import dtstudy.strategies.allreduce.spec",
            "dtstudy.strategies.spec -> dtstudy.strategies.allreduce.spec",
        ),
    ],
)
def test_an_upward_import_is_found(tmp_path, importer, line, expected):
    """The check can fail: one planted import, at the top or inside a function, is named."""
    modules = strategies_modules()
    name = f"{STRATEGIES_PACKAGE}.{importer.replace('/', '.')}"
    planted = tmp_path / Path(importer).with_suffix(".py").name
    planted.write_text(modules[name].read_text() + "\n" + line + "\n")
    assert upward_imports({**modules, name: planted}) == [expected]


def name_literals(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string literal in `path` that is exactly a strategy's name."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def where_typed(paths: list[Path], names: set[str]) -> dict[str, list[str]]:
    """{name: every 'file:line' of `paths` where it is typed}."""
    where: dict[str, list[str]] = {name: [] for name in names}
    for path in paths:
        for line, name in name_literals(path, names):
            where[name].append(f"{path}:{line}")
    return where


def test_each_strategy_name_is_typed_once_in_its_spec():
    from dtstudy.strategies.registry import STRATEGIES

    where = where_typed(sorted(STRATEGIES_DIR.rglob("*.py")), set(STRATEGIES))
    typed_again = {name: places for name, places in where.items() if len(places) != 1}
    assert not typed_again, f"a strategy's name is typed once, in its spec: {typed_again}"
    for name, [place] in where.items():  # and that one place is the spec its registered class names
        spec = STRATEGIES[name].spec
        assert place.startswith(str(PACKAGE.parent / spec.__module__.replace(".", "/")) + ".py:"), (name, place)
        assert spec.__dict__["name"] == name


def test_a_retyped_name_is_found(tmp_path):
    """The check can fail: a class that types its name again beside its spec is seen."""
    from dtstudy.strategies.registry import STRATEGIES

    original = STRATEGIES_DIR / "gossip" / "strategy.py"
    planted = tmp_path / "strategy.py"
    planted.write_text(
        original.read_text().replace("    spec = GossipSpec\n", '    spec = GossipSpec\n    name = "gossip"\n')
    )
    paths = [planted if path == original else path for path in sorted(STRATEGIES_DIR.rglob("*.py"))]
    where = where_typed(paths, set(STRATEGIES))
    assert [place.rsplit(":", 1)[0] for place in where["gossip"]] == [str(original.with_name("spec.py")), str(planted)]
    assert {name: len(places) for name, places in where.items() if len(places) != 1} == {"gossip": 2}


def test_a_strategys_class_takes_its_name_from_its_spec():
    from dtstudy.strategies.base import Strategy
    from dtstudy.strategies.registry import STRATEGIES
    from dtstudy.strategies.spec import StrategySpec

    assert all(strategy.name == strategy.spec.name for strategy in STRATEGIES.values())

    class ShinySpec(StrategySpec):
        name = "shiny"
        family = "synchronous"

    class Shiny(Strategy):
        spec = ShinySpec

    class ShinyVariant(Shiny):  # a subclass that gives no spec of its own is the same strategy
        pass

    assert (Shiny.name, ShinyVariant.name, ShinyVariant.spec) == ("shiny", "shiny", ShinySpec)


def test_the_registry_lists_exactly_the_strategies_the_schema_allows():
    """The schema names the strategies under strategy_params (additionalProperties: false, one
    entry each) and its `strategies` list refers to the registry: both tables hold those names,
    each to the spec its class names."""
    from dtstudy.config import schema
    from dtstudy.strategies.registry import STRATEGIES
    from dtstudy.strategies.specs import SPECS

    config_schema = schema.load_schema_file("config.schema.yaml")
    strategy_params = config_schema["properties"]["strategy_params"]
    assert strategy_params["additionalProperties"] is False
    assert len(STRATEGIES) == 14
    assert set(STRATEGIES) == set(SPECS) == set(strategy_params["properties"])
    assert all(STRATEGIES[name].spec is SPECS[name] for name in SPECS)
    assert "enum" not in config_schema["properties"]["strategies"]["items"], (
        "the schema types the strategies' names in an enum: hold it to the registry here"
    )
    assert set(config_schema["properties"]["strategies"]["default"]) <= set(STRATEGIES)


def test_a_strategy_imported_alone_has_its_knobs():
    """A spec takes its knobs from the schema when it is defined: a strategy's class imported
    without the specs' table (dtstudy.strategies.specs) checks its knobs as the config check does."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys; from dtstudy.strategies.gossip.strategy import Gossip; "
        "print(json.dumps([Gossip.check_params({}, 2), 'dtstudy.strategies.specs' in sys.modules]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"topology": "ring"}, False]
