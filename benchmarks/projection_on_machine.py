"""On this machine: calibrated on N=1 and the communication benchmark, how well the
performance model predicts the measured N=2 throughput (target: within 15%), measured side
by side in one run. Not a test: the machine's noise (identical runs differ by tens of
percent) decides too much of it; the figures are quoted in README ("Projection past the
machine").

    python3 benchmarks/projection_on_machine.py [--repeats 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = str(REPO / "workflow")
sys.path[:0] = [str(REPO / "tests"), WORKFLOW]

from conftest import run_snakemake, tiny_study  # noqa: E402
from dtstudy import calibration, hardware, projection  # noqa: E402
from dtstudy.config import validate_schema  # noqa: E402
from dtstudy import perfmodel as pm  # noqa: E402
from dtstudy.strategy_specs import PARAMETER_SERVERS, SPECS  # noqa: E402


# every strategy with an exchange to model (no_exchange has none). A parameter server's N=2
# run is three processes on the 2 cores (two workers and the shard, which waits in a receive
# most of the time: busy 4-8% of the run); the model charges the shard's work and the
# protocol's cost per round trip (measured on the N=1 parameter-server runs), not that sharing.
ON_MACHINE = [name for name in SPECS if name != "no_exchange"]
TOLERANCE = 0.15
MIN_CORE_SHARE = 0.8  # each of 2 busy processes must get this much of a core




def bracketed(before, after):
    """The mean of two benchmarks' numbers (fits, kernels, jitter, slowdown, core shares),
    one taken before the round's runs and one after: the machine's speed drifts within minutes."""
    if isinstance(before, dict):
        return {key: bracketed(before[key], after[key]) for key in before if key in after}
    if isinstance(before, (int, float)) and not isinstance(before, bool):
        return (before + after) / 2
    if isinstance(before, list):  # the message sizes' points: both benchmarks', for the fits' intervals
        return before + after
    return before


def checked_bench(when: str, gloo_loop_nice: int) -> dict:
    from dtstudy import commbench

    bench = commbench.measure(repeats=15, gloo_loop_nice=gloo_loop_nice)
    if bench["cpu_share"]["2"] < MIN_CORE_SHARE:
        raise SystemExit(f"{when}: the 2 cores are shared with other work (2 busy processes get "
                         f"{bench['cpu_share']['2']:.2f} of a core each): a throughput comparison would measure "
                         f"that contention")
    return bench


def one_repeat(tmp_path: Path, steps: int, strategies: list[str]) -> dict:
    """One round, in this order: the benchmark, the N=1 calibration runs (seed 0: allreduce,
    and each parameter server's), the N=2 run of each strategy, the N=1 runs again (seed 1),
    the benchmark again; the model calibrated on the mean of both benchmarks and of both
    seeds' N=1 runs, which bracket the N=2 runs in time.
    Returns {strategy: (predicted, measured)}."""
    # 8100 training images: 63 steps of 2 x 64 per epoch; enough epochs for `steps` at N=1
    study = tiny_study(strategies=strategies, workers=[1, 2], seeds=[0, 1], dataset={"subset": 9000},
                       train={"epochs": math.ceil(steps * 64 / 8100), "batch_size": 64, "max_steps": steps,
                              "steady_state_skip": 10})
    # gloo's event loops in the benchmark as in the runs (the commbench rule does the same)
    validated = validate_schema(copy.deepcopy(study))
    nice = validated["launcher"]["gloo_loop_nice"]
    before = checked_bench("before the runs", nice)
    # N=1 runs: the plain one (compute) and each parameter server's (the protocol's cost per
    # round trip), once before the N=2 runs (seed 0) and once after (seed 1)
    servers = [s for s in strategies if s in PARAMETER_SERVERS]
    before_runs, after_runs = ([f"results/runs/{s}/n1/seed{seed}/metrics.json" for s in ["allreduce", *servers]]
                               for seed in (0, 1))
    measured_runs = [f"results/runs/{s}/n2/seed0/metrics.json" for s in strategies]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = WORKFLOW + (os.pathsep + env_path if env_path else "")
    try:  # one Snakemake call per step, so that the order holds
        for targets in (before_runs, measured_runs, after_runs):
            done = run_snakemake(tmp_path, study, "--cores", "2", *targets)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
    finally:
        os.environ["PYTHONPATH"] = env_path
    bench = bracketed(before, checked_bench("after the runs", nice))
    runs = calibration.read_runs([tmp_path / t for t in before_runs + after_runs + measured_runs])
    parameters = calibration.parameters_from_runs(runs)
    single = [r for r in runs if r["workers"] == 1 and r["comm_s"] == 0]
    workload, _ = calibration.workload_from_runs(runs, parameters)  # N=1 compute; PowerSGD's bytes at N=2
    workload, _ = calibration.with_study_layers(workload, validated["model"])  # as the study's `project` rule
    profile = hardware.load_profile("this_machine")
    machine, _, _ = hardware.machine_from_profile(profile, bench)
    params = hardware.check_strategy_params(profile, strategies, pm.knob_defaults())
    machine, request_source = calibration.with_ps_request(machine, profile, runs, workload, params)
    fit = bench["fit"]["allreduce"]  # printed: the calibration inputs are what swings between repeats
    steps_ms = " then ".join(f"{(r['total_s'] + r['data_s']) * 1e3:.2f}" for r in single)
    print(f"all-reduce fit: latency {fit['latency_s'] * 1e6:.0f} us, bandwidth {fit['bandwidth'] / 1e9:.2f} GB/s; "
          f"compute scale at 2 busy {bench['compute_scale']['2']:.3f}; N=1 compute {steps_ms} ms; "
          f"skew {machine.skew_fraction:.3f}; core share {bench['cpu_share']}"
          + (f"; parameter-server round trip {request_source}" if request_source else ""))
    # the prediction with its band, as the study's rule has them (projection.project)
    band, _ = calibration.band_variants(workload, machine, profile, runs, params, bench)
    measured = {r["strategy"]: r["throughput"] for r in runs if r["workers"] == 2}
    result = {}
    for row in projection.project(workload, machine, list(measured), [2], params, profile["name"], band=band):
        predicted, low, high = row["throughput"], row["throughput_low"], row["throughput_high"]
        seen = measured[row["strategy"]]
        result[row["strategy"]] = (predicted, seen, low, high)
        print(f"  {row['strategy']:16s} predicted {predicted:8.0f} [{low:.0f}, {high:.0f}]  measured {seen:8.0f}  "
              f"{100 * (predicted / seen - 1):+6.1f}%{'' if low <= seen <= high else '  outside the band'}")
    return result


def main(repeats: int, steps: int, strategies: list[str]) -> None:
    """`repeats` rounds one after the other; the verdict on the medians of each side, with the
    rounds' ranges beside them (a single round of 60 steps moves by tens of percent here)."""
    rounds = []
    for k in range(repeats):
        print(f"round {k + 1} of {repeats}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            rounds.append(one_repeat(Path(folder), steps, strategies))
    print(f"\nmedians over {repeats} rounds (min-max); strategy, predicted, measured images/s at N=2, error")
    misses, single = [], 0
    for strategy in strategies:
        predicted = [r[strategy][0] for r in rounds]
        measured = [r[strategy][1] for r in rounds]
        error = statistics.median(predicted) / statistics.median(measured) - 1
        print(f"{strategy:16s} {statistics.median(predicted):8.0f} ({min(predicted):.0f}-{max(predicted):.0f}) "
              f"{statistics.median(measured):8.0f} ({min(measured):.0f}-{max(measured):.0f}) {100 * error:+6.1f}%")
        if abs(error) > TOLERANCE:
            misses.append(strategy)
    single = sum(all(abs(p / m - 1) <= TOLERANCE for p, m, _, _ in r.values()) for r in rounds)
    print(f"within {TOLERANCE:.0%} (medians): {len(strategies) - len(misses)} of {len(strategies)}"
          + (f"; beyond: {', '.join(misses)}" if misses else "")
          + f"; rounds with all {len(strategies)} within: {single} of {repeats}")
    inside = sum(low <= m <= high for r in rounds for _, m, low, high in r.values())
    print(f"measured inside the band (the calibration's noise; outside it, the model's own error): {inside} of "
          f"{len(strategies) * repeats} strategy-rounds")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds, one after the other (default 5)")
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps of every run, N=1 (the calibration) and N=2 (default 300)")
    parser.add_argument("--strategies", default=",".join(ON_MACHINE),
                        help="comma-separated (default: every two-process strategy)")
    args = parser.parse_args()
    main(args.repeats, args.steps, args.strategies.split(","))
