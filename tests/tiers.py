"""The test tiers, a pytest plugin (conftest.py loads it). `python3 -m pytest` is the quick tier:
maths, config, docs, structure, style and short training runs. The tests that carry one of
LONG_MARKERS join it under `--full`, which .ci/run uses. An explicit `-m` expression chooses alone."""

from __future__ import annotations

LONG_MARKERS = ("slow", "e2e", "slurm")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="run every tier: also the tests marked slow, e2e or slurm (what .ci/run runs)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    long_items = [item for item in items if any(item.get_closest_marker(marker) for marker in LONG_MARKERS)]
    if long_items:
        config.hook.pytest_deselected(items=long_items)
        items[:] = [item for item in items if item not in long_items]
