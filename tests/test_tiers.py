"""The tiers plugin (tests/tiers.py): the quick tier leaves out exactly the tests marked slow, e2e
or slurm; --full and an explicit -m bring them back."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_long():
    pass

@pytest.mark.e2e
def test_workflow():
    pass

@pytest.mark.slurm
def test_cluster():
    pass
"""


@pytest.fixture
def suite(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n    e2e: workflow\n    slurm: cluster\n")
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def ran(result) -> set[str]:
    return {
        report.nodeid.split("::")[-1]
        for report in result.getreports("pytest_runtest_logreport")
        if report.when == "call"
    }


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], {"test_quick"}),
        (["--full"], {"test_quick", "test_long", "test_workflow", "test_cluster"}),
        (["-m", "slurm"], {"test_cluster"}),
        (["-m", "slow or e2e"], {"test_long", "test_workflow"}),
    ],
)
def test_the_tiers_select(suite, args, expected):
    result = suite.inline_run("-p", "tiers", "--strict-markers", *args)
    assert ran(result) == expected


def test_the_quick_tier_says_what_it_left_out(suite):
    result = suite.runpytest("-p", "tiers")
    result.stdout.fnmatch_lines(["*1 passed, 3 deselected*"])
