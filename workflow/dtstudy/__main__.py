"""Command line of the study: `python -m dtstudy <command> --help`.

Snakemake rules call these commands with `--config-json` (the validated config, or the part
of it a run depends on); by hand, `--config config/config.yaml` does the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dtstudy.config import run_kinds, study_config
from dtstudy.errors import ConfigError


def _config(args) -> dict:
    if args.config_json:
        return json.loads(args.config_json)
    # here, not at the top: the checks import the projection and scipy, a second or two of
    # start-up each rule's command would pay for a config that comes as JSON
    from dtstudy.checks import load_config

    return load_config(args.config)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", default="config/config.yaml", help="study config YAML (validated and checked)")
    group.add_argument("--config-json", help="config as JSON, already validated (what the rules pass)")


def cmd_check_config(args) -> None:
    cfg = _config(args)
    per_kind = [
        f"{run_kinds.run_count(cfg, kind)} {kind} runs ({len(cfg['strategies'])} strategies x "
        f"N={run_kinds.workers(cfg, kind)} x seeds {run_kinds.seeds(cfg, kind)})"
        for kind in run_kinds.kinds_run(cfg)
    ]
    total = sum(run_kinds.run_count(cfg, kind) for kind in run_kinds.kinds_run(cfg))
    print(f"config OK: {total} training runs: " + "; ".join(per_kind))


def cmd_budget(args) -> None:
    """The study's predicted cost (dtstudy.projection.budget) on every profile its config names,
    before anything runs; a study over launcher.gpu_hour_budget is refused after the table."""
    from dtstudy.checks import check_config, count_training_images
    from dtstudy.config.study_config import deep_merge, read_yaml, validate_schema
    from dtstudy.projection import budget

    config = read_yaml(args.base)
    for path in args.configfile:  # on top of each other, as Snakemake merges --configfile
        config = deep_merge(config, read_yaml(path))
    config = deep_merge(config, budget.overrides(args.set))
    validate_schema(config)
    check_config(config, check_data=False)
    try:
        counted, why_not = count_training_images(config), ""
    except ConfigError as err:  # not on disk here: launcher.budget_train_images stands in
        counted, why_not = None, str(err)
    images = budget.study_images(config, counted, why_not)
    result = budget.report(config, images)
    print(budget.render(result, config["launcher"]["gpu_hour_budget"]))
    if args.record:
        budget.write_record(args.record, args.record_as, [args.base, *args.configfile], args.set, result)
        print(f"written to {args.record} as {args.record_as!r}")
    budget.check_study(config, images)


def cmd_prepare_data(args) -> None:
    from dtstudy.data.prepare import prepare

    meta = prepare(_config(args)["dataset"], args.out)
    print(f"prepared {meta['name']} in {args.out}: {meta['sizes']}")


def cmd_init_tracking(args) -> None:
    from dtstudy.tracking.mlflow_store import init_store, resolve_uri

    tracking = _config(args)["tracking"]
    uri = resolve_uri(tracking["uri"])
    experiment_id = init_store(uri, tracking["experiment"])
    marker = Path(args.marker)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(
        json.dumps({"tracking_uri": uri, "experiment": tracking["experiment"], "experiment_id": experiment_id})
    )
    print(f"MLflow store ready: {uri} (experiment {tracking['experiment']!r}, id {experiment_id})")


def cmd_train(args) -> None:
    from dtstudy.launch.launcher import TrainingJobFailed, run_training_job
    from dtstudy.launch_backends.registry import launch_backend
    from dtstudy.projection import budget
    from dtstudy.runspec import RunSpec

    cfg = _config(args)
    if "strategies" in cfg:  # a whole study config: keep what this run depends on
        cfg = study_config.run_config(cfg, args.strategy)
    if args.operational_json:  # the rules pass the launch keys apart (study_config.OPERATIONAL_KEYS)
        cfg = study_config.deep_merge(cfg, json.loads(args.operational_json))
    # a variant's run (config `variants`) is a run of its strategy, its run config naming it
    strategy = (cfg.get(study_config.VARIANT_KEY) or {}).get("strategy", args.strategy)
    spec = RunSpec(
        strategy=strategy,
        workers=args.workers,
        seed=args.seed,
        config=cfg,
        data_dir=args.data,
        out_dir=args.out,
        tracking_uri=None if args.no_tracking else study_config.tracking_uri(cfg["tracking"]["uri"]),
    )
    job_dir = args.job_dir or str(spec.folder.job_logs)
    # on SLURM with launcher.hardware: the job asks its predicted time, not timeout_min
    time_limit_min = budget.job_time_limit_min(cfg, strategy, args.workers, args.data)
    backend = launch_backend(cfg)
    pooled = backend.emulated and backend.uses_pool(cfg["launcher"])
    try:
        if pooled:  # N logical workers in a process the pool forks
            from dtstudy.launch.pool.client import PoolError, pool_address, request_emulated_run

            try:
                threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}  # Snakemake's, for the rule
                metrics = request_emulated_run(pool_address(), spec, threads)
            except PoolError as err:
                raise TrainingJobFailed(str(err)) from None
        elif backend.emulated:  # N logical workers in this process: no job to submit
            from dtstudy.emulation.runner import run_emulated

            metrics = run_emulated(spec)
        else:
            metrics = run_training_job(spec, job_dir, time_limit_min=time_limit_min)
    except TrainingJobFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(
        f"{spec.run_name}: {metrics['throughput']:.0f} img/s, final val top-1 {metrics['final_val_top1']:.4f}, "
        f"wall {metrics['wall_time_s']:.1f}s" + (" (in the warm pool)" if pooled else "")
    )


def cmd_evaluate(args) -> None:
    if args.via_pool:  # the study's warm pool evaluates: no torch import here
        from dtstudy.launch.pool.client import PoolError, pool_address, request_evaluation

        try:
            result = request_evaluation(pool_address(), args.run, args.data, args.out)
        except PoolError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        print(
            f"{result['run_name']}: test top-1 {result['top1']:.4f} top-5 {result['top5']:.4f} "
            f"on {result['test_images']} images (in the warm pool)"
        )
        return
    from dtstudy.training.evaluate import evaluate_run

    evaluate_run(args.run, args.data, args.out)


def cmd_pool_stop(args) -> None:
    from dtstudy.launch.pool.client import pool_address, stop

    stopped = stop(pool_address(args.study_dir))
    print("warm pool: asked to stop" if stopped else "warm pool: none running")


def cmd_aggregate(args) -> None:
    from dtstudy.analysis.aggregate import aggregate_study
    from dtstudy.tracking.mlflow_store import resolve_uri

    cfg = _config(args)
    done = aggregate_study(
        args.runs,
        args.tables,
        args.plots,
        tracking_uri=resolve_uri(cfg["tracking"]["uri"]),
        experiment=cfg["tracking"]["experiment"],
        strategies_order=cfg["strategies"],
        study_params=cfg,
        wait_for_server_s=cfg["tracking"]["wait_for_server_s"],
    )
    if args.study_run:  # where the study run is, for the steps after this one (the projection)
        from dtstudy.common.atomic_files import write_json

        write_json(
            args.study_run,
            {
                "run_id": done["parent_run_id"],
                "tracking_uri": done["tracking_uri"],
                "experiment": cfg["tracking"]["experiment"],
            },
        )


def cmd_project_commbench(args) -> None:
    """This machine's communication benchmark (dtstudy.projection.commbench), what `project
    study` calibrates the model's exchange on."""
    from dtstudy.projection import commbench

    commbench.write(args.out, gloo_loop_nice=args.gloo_loop_nice)
    print(f"communication benchmark written to {args.out}")


def cmd_project_study(args) -> None:
    """The project rule: the model calibrated on the study's runs and the communication
    benchmark, every strategy of the study projected (dtstudy.projection.project.run_study)."""
    from dtstudy.projection import project

    project.run_study(args.metrics, args.commbench, _config(args), args.out, args.out_md, args.plot)
    print(f"projection written to {args.out}, {args.out_md}, {args.plot}")
    if args.study_run:  # beside the study's tables and plots in MLflow
        from dtstudy.tracking import mlflow_store

        study_run = json.loads(Path(args.study_run).read_text())
        mlflow_store.attach_artifacts(
            study_run["tracking_uri"],
            study_run["run_id"],
            dict.fromkeys([args.out, args.out_md, args.plot], "projection"),
        )
        print(f"projection logged to the MLflow study run {study_run['run_id']} (artifacts: projection/)")


def cmd_project_measured(args) -> None:
    """A measurement file's throughput projected on a hardware profile, no study
    (dtstudy.projection.project.run_command)."""
    from dtstudy.projection import project

    rows = project.run_command(args.measured, args.hardware, args.strategies, args.workers, args.out)
    print(f"{len(rows)} projections written to {args.out}")


def _add_project_parser(commands) -> None:
    """`project <mode>`: one sub-command per thing it does, each with its own required arguments."""
    p = commands.add_parser("project", help="project throughput and efficiency to many GPUs (alpha-beta model)")
    # no dest: a missing mode is named by its choices
    modes = p.add_subparsers(required=True)

    m = modes.add_parser("commbench", help="measure this machine's collectives (the commbench rule)")
    m.add_argument("--out", required=True, help="JSON file to write")
    m.add_argument(
        "--gloo-loop-nice",
        type=lambda value: value if value == "idle" else int(value),
        default=0,
        help="gloo's event loops at this priority, idle or a nice value (launcher.gloo_loop_nice)",
    )
    m.set_defaults(func=cmd_project_commbench)

    m = modes.add_parser("study", help="project the study's strategies, calibrated on its runs (the project rule)")
    m.add_argument("--metrics", nargs="+", required=True, help="the runs' metrics.json files")
    m.add_argument("--commbench", required=True, help="this machine's communication benchmark (JSON)")
    m.add_argument("--out", required=True, help="the CSV table")
    m.add_argument("--out-md", required=True, help="the Markdown table")
    m.add_argument("--plot", required=True, help="the plot (PNG)")
    m.add_argument(
        "--study-run",
        help="the aggregate step's record of the MLflow study run (JSON), whose artifacts the projection joins",
    )
    _add_config_args(m)
    m.set_defaults(func=cmd_project_study)

    m = modes.add_parser("measured", help="project a measurement file's throughput on a hardware profile")
    m.add_argument(
        "--measured", required=True, help="measurement file: model, per_worker_batch, throughput {N: images/s}"
    )
    m.add_argument("--hardware", required=True, help="hardware profile: a path or a name in config/hardware/")
    m.add_argument("--strategies", required=True, help="comma-separated strategy names")
    m.add_argument("--workers", required=True, help="comma-separated worker counts N")
    m.add_argument("--out", default="projection.csv", help="CSV to write (a .md beside it)")
    m.set_defaults(func=cmd_project_measured)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dtstudy", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("check-config", help="validate a study config and count its runs")
    _add_config_args(p)
    p.set_defaults(func=cmd_check_config)

    p = commands.add_parser("budget", help="the study's predicted wall time and GPU-hours per run, before submitting")
    p.add_argument("--configfile", nargs="*", default=[], help="config files on top of --base, as Snakemake's")
    p.add_argument("--base", default="config/config.yaml", help="the Snakefile's own config (always the base)")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="a config key by its dotted name, its value in YAML (train.precision=fp32), last",
    )
    p.add_argument("--record", help="also write the prediction into this JSON file (docs/records/budget.json)")
    p.add_argument("--record-as", default="cluster", help="with --record: the entry's name in the file")
    p.set_defaults(func=cmd_budget)

    p = commands.add_parser("prepare-data", help="prepare the data set once for every worker")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="folder for the prepared splits")
    p.set_defaults(func=cmd_prepare_data)

    p = commands.add_parser("init-tracking", help="create the MLflow store and experiment once")
    _add_config_args(p)
    p.add_argument("--marker", required=True, help="file written when the store is ready")
    p.set_defaults(func=cmd_init_tracking)

    p = commands.add_parser("train", help="one training run (strategy x N x seed) as a submitit job")
    _add_config_args(p)
    p.add_argument("--strategy", required=True)
    p.add_argument("--workers", type=int, required=True, help="N data-parallel workers")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--data", required=True, help="prepared data folder")
    p.add_argument("--out", required=True, help="run folder (metrics.json, model.pt)")
    p.add_argument("--job-dir", help="submitit's folder for the job's logs (default: <out>/submitit)")
    p.add_argument(
        "--operational-json",
        help="the run's launch keys as JSON, merged over --config-json (the rules "
        "pass them apart: changing them reruns nothing)",
    )
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    p.set_defaults(func=cmd_train)

    p = commands.add_parser("evaluate", help="test top-1/top-5 of a run's final checkpoint")
    p.add_argument("--run", required=True, help="run folder")
    p.add_argument("--data", required=True, help="prepared data folder")
    p.add_argument("--out", required=True, help="eval.json to write")
    p.add_argument("--via-pool", action="store_true", help="evaluate in the study's warm pool (local studies)")
    p.set_defaults(func=cmd_evaluate)

    p = commands.add_parser("pool-stop", help="stop the study's warm pool (it also stops when idle)")
    p.add_argument("--study-dir", default=None, help="the study folder (default: the working directory)")
    p.set_defaults(func=cmd_pool_stop)

    p = commands.add_parser("aggregate", help="scaling/accuracy tables, plots and the MLflow study run")
    _add_config_args(p)
    p.add_argument("--runs", nargs="+", required=True, help="run folders")
    p.add_argument("--tables", required=True)
    p.add_argument("--plots", required=True)
    p.add_argument("--study-run", help="write where the MLflow study run is (JSON: run_id, tracking_uri, experiment)")
    p.set_defaults(func=cmd_aggregate)

    _add_project_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
