"""What an emulated run costs (launcher.cluster: emulate, docs/emulation.md), side by side with
a real one in one run: one epoch of LeNet-5 on Fashion-MNIST (or its first --subset images),
the same per-worker batch, as

  real N=1       the real path (run_training_job, launcher.cluster local, one submitit task:
                 the worker process on one torch thread, as a study's worker runs);
  emulated N=64  64 logical workers of allreduce in this process, on --threads torch threads.

Both see the same images per epoch (64 workers take 1/64 of them each), so the emulated run
does the compute of the real one in 64 x fewer steps per worker, plus 64 workers' set-up,
DDP's bucket work and the emulated collectives. Printed: each run's wall time (the training
loop, metrics.json's host figure: steps and the epoch's validation) and the whole call
(set-up included), and their ratio emulated / real (the issue's target: <= 1.5). The runs
alternate (real, emulated, real, ...) --repeats times, so that drift of the machine hits both;
figures are medians.

    python3 benchmarks/emulation.py [--subset 20000] [--workers 64] [--batch 32] [--repeats 3]
                                    [--threads 1] [--out results/benchmarks/emulation.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

RATE = 10_000.0  # images/s of the emulated GPU: any rate; the host's cost does not depend on it


def study(workers: int, batch: int, subset: int | None, cluster: str, tracking_uri: str) -> dict:
    from dtstudy.checks import check_config
    from dtstudy.config.study_config import validate_schema

    config = validate_schema(
        {
            "dataset": {"name": "fashion_mnist", "subset": subset},
            "model": "lenet5",
            "strategies": ["allreduce"],
            "workers": [workers],
            "seeds": [0],
            "train": {"epochs": 1, "batch_size": batch, "log_every": 100000},
            "launcher": {"cluster": cluster, "local_processes": "tasks"},
            "emulate": {"images_per_s": RATE},
            "tracking": {"uri": tracking_uri},
        }
    )
    check_config(config, check_data=False)
    return config


def one_run(config: dict, workers: int, data_dir: Path, out: Path) -> dict:
    from dtstudy.config.study_config import run_config
    from dtstudy.emulation.runner import run_emulated
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec

    spec = RunSpec(
        strategy="allreduce",
        workers=workers,
        seed=0,
        config=run_config(config, "allreduce"),
        data_dir=str(data_dir),
        out_dir=str(out),
    )
    start = time.perf_counter()
    emulated = config["launcher"]["cluster"] == "emulate"
    metrics = run_emulated(spec) if emulated else run_training_job(spec, out / "submitit")
    call_s = time.perf_counter() - start
    emulation = metrics.get("emulation")
    loop_s = emulation["host_loop_wall_time_s"] if emulation else metrics["wall_time_s"]
    return {
        "loop_s": loop_s,
        "call_s": call_s,
        "steps": metrics["steps"],
        "images": metrics["images"],
        "final_val_top1": metrics["final_val_top1"],
        "emulated_wall_time_s": emulation["wall_time_s"] if emulation else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", type=int, default=None, help="first K training images (default: all)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch of both runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the emulated run (real: 1)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()

    import torch

    from dtstudy.data.prepare import prepare

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="dtstudy-emulation-") as tmp:
        tmp = Path(tmp)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        real_config = study(1, args.batch, args.subset, "local", uri)
        emulated_config = study(args.workers, args.batch, args.subset, "emulate", uri)
        data_dir = tmp / "data"
        prepare(real_config["dataset"], data_dir)
        rounds = []
        for i in range(args.repeats):
            real = one_run(real_config, 1, data_dir, tmp / f"real{i}")
            emulated = one_run(emulated_config, args.workers, data_dir, tmp / f"emulated{i}")
            rounds.append(
                {
                    "real_n1": real,
                    f"emulated_n{args.workers}": emulated,
                    "ratio_loop": emulated["loop_s"] / real["loop_s"],
                    "ratio_call": emulated["call_s"] / real["call_s"],
                }
            )
            print(
                f"round {i + 1}: real N=1 {real['loop_s']:.2f} s loop ({real['call_s']:.2f} s call, "
                f"{real['steps']} steps), emulated N={args.workers} {emulated['loop_s']:.2f} s loop "
                f"({emulated['call_s']:.2f} s call, {emulated['steps']} steps/worker): ratio "
                f"{rounds[-1]['ratio_loop']:.2f} (calls {rounds[-1]['ratio_call']:.2f})",
                flush=True,
            )
    summary = {
        "what": f"one epoch of LeNet-5, allreduce: emulated N={args.workers} vs real N=1, "
        f"per-worker batch {args.batch}",
        "images": rounds[0]["real_n1"]["images"],
        "subset": args.subset,
        "threads_emulated": args.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads()},
        "median_ratio_loop": statistics.median(r["ratio_loop"] for r in rounds),
        "median_ratio_call": statistics.median(r["ratio_call"] for r in rounds),
        "rounds": rounds,
    }
    print(
        f"median ratio emulated/real: loop {summary['median_ratio_loop']:.2f}, "
        f"whole call {summary['median_ratio_call']:.2f} (target <= 1.5)"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
