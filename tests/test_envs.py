"""The pip requirements and the conda environment install the same pinned packages."""

from __future__ import annotations

import yaml
from conftest import REPO


def test_conda_env_pins_equal_pip_requirements():
    requirements = [
        line.strip()
        for line in (REPO / "envs/requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    conda = yaml.safe_load((REPO / "envs/study.yaml").read_text())
    pip_section = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict))
    assert pip_section == requirements
    assert "torch==2.14.1" in requirements and "torchvision==0.29.1" in requirements
