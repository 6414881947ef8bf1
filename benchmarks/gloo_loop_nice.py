"""What `launcher.gloo_loop_nice` does to training, measured side by side in one run (not a
test: prints ratios): the study's training runs (the warm pool, pinned workers, the default
study's recipe from config/config.yaml, cut to `--steps`) with gloo's event-loop threads at
each of `--priorities` (a nice value, 0 = as gloo starts them, or idle = SCHED_IDLE),
alternating run by run so that drift of the machine hits all. Prints each run's images/s
and per-step compute and exchange times, then per strategy and N the median ratio of
throughput (each priority / the first) with its range over the repeats. Why: docs/running-locally.md
"Cores"; how to run it: docs/benchmarks.md.

    python3 benchmarks/gloo_loop_nice.py [--runs allreduce:2,allreduce:4,ps_async:2]
                                         [--priorities 0,19,idle] [--repeats 3] [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml

from dtstudy.config.study_config import run_config, validate_schema
from dtstudy.data.prepare import prepare
from dtstudy.launch.launcher import run_training_job
from dtstudy.runspec import RunSpec

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


def parse_runs(text: str) -> list[tuple[str, int]]:
    """'allreduce:2,ps_async:2' -> [('allreduce', 2), ('ps_async', 2)]."""
    runs = []
    for item in text.split(","):
        strategy, _, workers = item.partition(":")
        runs.append((strategy, int(workers)))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="allreduce:2,allreduce:4,ps_async:2", help="strategy:N, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--priorities", default="0,19,idle", help="gloo_loop_nice values, comma-separated")
    args = parser.parse_args()
    runs = parse_runs(args.runs)
    priorities = [p if p == "idle" else int(p) for p in args.priorities.split(",")]
    train = {
        **yaml.safe_load(DEFAULT_CONFIG.read_text())["train"],
        "max_steps": args.steps,
        "steady_state_skip": 20,
        "log_every": 10**6,
        "evals_per_epoch": 1,
    }
    throughput: dict[tuple[str, int, int | str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = tmp / "data"
        prepare(validate_schema({"train": dict(train)})["dataset"], data_dir)
        for repeat in range(args.repeats):
            for strategy, workers in runs:
                for nice in priorities:
                    study = validate_schema({"train": dict(train), "launcher": {"gloo_loop_nice": nice}})
                    out = tmp / f"{strategy}-n{workers}-nice{nice}-{repeat}"
                    spec = RunSpec(strategy, workers, 0, run_config(study, strategy), str(data_dir), str(out))
                    metrics = run_training_job(spec, out / "submitit")
                    throughput.setdefault((strategy, workers, nice), []).append(metrics["throughput"])
                    step = metrics["step_time"]
                    print(
                        f"repeat {repeat + 1}: {strategy} N={workers} loop {nice!s:>4s}: "
                        f"{metrics['throughput']:6.0f} img/s, step compute {step['compute_s'] * 1e3:.2f} ms, "
                        f"exchange {step['comm_s'] * 1e3:.2f} ms",
                        flush=True,
                    )
    print(
        f"\nLeNet-5, batch {train['batch_size']} per worker, {args.steps} steps, {args.repeats} repeats; "
        f"images/s medians"
    )
    for strategy, workers in runs:
        first, *others = (throughput[(strategy, workers, nice)] for nice in priorities)
        cells = [f"loop {priorities[0]}: {statistics.median(first):6.0f}"]
        for nice, values in zip(priorities[1:], others):
            ratios = [b / a for a, b in zip(first, values)]
            cells.append(
                f"loop {nice}: {statistics.median(values):6.0f}, ratio {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(f"{strategy:18s} N={workers}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
