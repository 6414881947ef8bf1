"""What one more training run costs beyond its training, measured side by side in one run.

Fixed cost per run = (Snakemake wall time of a study of 5 runs - that of the same study
with 1 run) / 4 - the mean training wall time (`wall_time_s`) of a run. The two studies
differ only in `seeds` ([0..4] against [0]), so data preparation, MLflow set-up,
aggregation and the warm pool's start cancel out. Each study runs in a fresh folder; the
studies alternate (1 run, 5 runs, 1 run, ...) for each strategy, so that drift of the
machine hits all of them; figures are medians with their min-max over the repeats.

Parts of a run (medians over the 5-run studies' runs, from each run's `timings` in
metrics.json and the file times of its outputs):
  launch      the launcher's submission until the job's task runs (submitit, the pool client)
  workers up  the task until training starts (fork, process group, data, model, MLflow run)
  training    the run's wall_time_s (steps and validation)
  outputs     training end until metrics.json is written (final model, summary, MLflow)
  evaluation  metrics.json until eval.json (the evaluate rule: Snakemake, the pool, the test pass)

    python3 benchmarks/fixed_cost.py [--repeats 3] [--strategies allreduce,ps_sync]
                                     [--default-study]   # also time `snakemake --cores all`
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def study_config(strategy: str, seeds: list[int]) -> dict:
    """allreduce-like N=2 runs on 3000 images for 1 epoch (the issue's measurement)."""
    return {
        "dataset": {"name": "fashion_mnist", "subset": 3000},
        "strategies": [strategy],
        "workers": [2],
        "seeds": seeds,
        "train": {"epochs": 1, "batch_size": 64},
    }


def run_study(workdir: Path, config: dict | None, snakemake_args: tuple[str, ...] = ()) -> float:
    """Snakemake wall time of the study in `workdir` (config None: the default study)."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--cores",
        "all",
        "--directory",
        str(workdir),
        "--quiet",
        *snakemake_args,
        "--configfile",
        str(REPO / "config/config.yaml"),
    ]
    if config is not None:
        (workdir / "study.yaml").write_text(yaml.safe_dump(config))
        command += [str(workdir / "study.yaml")]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"study in {workdir} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return wall


def run_parts(workdir: Path) -> list[dict]:
    parts = []
    for metrics_path in sorted(workdir.glob("results/runs/*/n*/seed*/metrics.json")):
        metrics = json.loads(metrics_path.read_text())
        eval_path = metrics_path.with_name("eval.json")
        timings = metrics["timings"]
        task_start = timings.get("task_start", timings["process_start"])
        parts.append(
            {
                "launch": task_start - timings["submitted"],
                "workers up": timings["training_start"] - task_start,
                "training": metrics["wall_time_s"],
                "outputs": metrics_path.stat().st_mtime - timings["training_end"],
                "evaluation": eval_path.stat().st_mtime - metrics_path.stat().st_mtime,
            }
        )
    return parts


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} s  [{min(values):.2f} - {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", default="allreduce,ps_sync", help="'' for none")
    parser.add_argument("--default-study", action="store_true", help="also time the default study")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtstudy-fixed-cost-"))
    print(f"machine: {os.cpu_count()} cores; studies in {root}", flush=True)
    try:
        for strategy in filter(None, args.strategies.split(",")):
            costs, walls, parts = [], {1: [], 5: []}, []
            for repeat in range(args.repeats):
                one = run_study(root / f"{strategy}-1-{repeat}", study_config(strategy, [0]))
                five = run_study(root / f"{strategy}-5-{repeat}", study_config(strategy, [0, 1, 2, 3, 4]))
                runs = run_parts(root / f"{strategy}-5-{repeat}")
                training = statistics.mean(run["training"] for run in runs)
                costs.append((five - one) / 4 - training)
                walls[1].append(one)
                walls[5].append(five)
                parts += runs
                print(
                    f"  {strategy} repeat {repeat + 1}: 1 run {one:.1f} s, 5 runs {five:.1f} s, "
                    f"training {training:.2f} s/run -> fixed cost {costs[-1]:.2f} s/run",
                    flush=True,
                )
            print(f"\n{strategy} N=2 (3000 images, 1 epoch), {args.repeats} repeats: median [min - max]")
            print(f"  study of 1 run       {spread(walls[1])}")
            print(f"  study of 5 runs      {spread(walls[5])}")
            print(f"  FIXED COST PER RUN   {spread(costs)}")
            for name in ("launch", "workers up", "training", "outputs", "evaluation"):
                print(f"    {name:<18} {spread([run[name] for run in parts])}")
            print(flush=True)
        if args.default_study:
            wall = run_study(root / "default", None)
            runs = len(list((root / "default").glob("results/runs/*/n*/seed*/metrics.json")))
            print(f"default study (config/config.yaml, {runs} runs): {wall / 60:.1f} min of Snakemake wall time")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
