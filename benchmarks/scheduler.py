"""What Snakemake's job scheduler costs a study of many short runs: `--scheduler ilp` (its
default, an integer program solved by CBC each time jobs are chosen) against `greedy`,
measured side by side in one run.

The study: every strategy of config/config.yaml at N = 1 and 2, one seed, 3000 images for 1
epoch (each run trains well under a second), so that what lies between the jobs shows. The
two schedulers alternate (ilp, greedy, ilp, ...), each study in a fresh folder; figures are
medians with their min-max over the repeats, and the ratio ilp / greedy pair by pair.

    python3 benchmarks/scheduler.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import yaml
from fixed_cost import REPO, run_study, spread


def study_config() -> dict:
    strategies = yaml.safe_load((REPO / "config/config.yaml").read_text())["strategies"]
    return {
        "dataset": {"name": "fashion_mnist", "subset": 3000},
        "strategies": strategies,
        "workers": [1, 2],
        "seeds": [0],
        "train": {"epochs": 1, "batch_size": 64},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtstudy-scheduler-"))
    config = study_config()
    runs = len(config["strategies"]) * len(config["workers"])
    print(f"machine: {os.cpu_count()} cores; {runs} runs per study; studies in {root}", flush=True)
    walls: dict[str, list[float]] = {"ilp": [], "greedy": []}
    try:
        for repeat in range(args.repeats):
            for scheduler in walls:
                walls[scheduler].append(run_study(root / f"{scheduler}-{repeat}", config, ("--scheduler", scheduler)))
                print(f"  repeat {repeat + 1}: {scheduler:6s} {walls[scheduler][-1]:.1f} s", flush=True)
        print(f"\nstudy of {runs} short runs (and their evaluations), {args.repeats} repeats: median [min - max]")
        for scheduler, values in walls.items():
            print(f"  --scheduler {scheduler:<8} {spread(values)}")
        ratios = [a / b for a, b in zip(walls["ilp"], walls["greedy"])]
        print(f"  ilp / greedy          {statistics.median(ratios):.3f}  [{min(ratios):.3f} - {max(ratios):.3f}]")
        per_job = [(a - b) / (2 * runs) for a, b in zip(walls["ilp"], walls["greedy"])]
        print(f"  difference per job    {spread(per_job)}  (train + evaluate jobs)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
