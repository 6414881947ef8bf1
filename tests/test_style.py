"""The code's style is checked, not argued: ruff (lint and format) over the Python and snakefmt
over the Snakemake rules, with the settings of pyproject.toml, as .ci/run checks them."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import REPO

CHECKS = {
    "ruff lint": ["ruff", "check", "--no-cache", "."],
    "ruff format": ["ruff", "format", "--check", "--no-cache", "."],
    "snakefmt": ["snakefmt", "--check", "Snakefile", "workflow/rules"],
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_tree_is_clean_under(check):
    command = CHECKS[check]
    assert shutil.which(command[0]), f"{command[0]} is not installed: bash envs/setup.sh installs it"
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} finds:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
