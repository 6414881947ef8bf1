"""What a study costs before anything is submitted: each run's predicted wall time and
GPU-hours on a hardware profile, its job's time limit, the study's total against
launcher.gpu_hour_budget.

The prediction of one run (kind, strategy, N), torch-free (the Snakefile's check and the budget
command run it on a login node); each kind of run (dtstudy.config.run_kinds) is costed with
the train section its runs get, at its own N and seeds:

- steps = epochs x floor(ceil(train images / N) / b), or fewer (train.max_steps, a scaling
  run's scaling.warmup_steps + scaling.steps, no_exchange's own `steps`): the training
  loop's DistributedSampler pads each worker's share to ceil(images / N) and its batches
  drop the last partial one; b the per-worker batch;
- train = steps x the step the performance model gives at N (its spec's model_step) on the
  profile, with the compute of a step at N = 1 = b / the profile's `train_images_per_s` of
  the study's model, the model's parameters and layer profile from layer_profiles.json;
- evaluation: each worker's share of the validation images it scores (every epoch's end, or
  the grid's points and the whole split once), at the forward pass's share of a training
  image's FLOPs (the layer profile's);
- STARTUP_S per attempt of the job (interpreter, imports, the process group, the model and
  the data set's index): an assumption, not a measurement;
- GPU-hours = wall x N: every worker holds one GPU, and a job asks for no more (the parameter-
  server shards compute on CPUs).

Not counted: the queue, a requeue's lost work since the last checkpoint, checkpoint writes,
the test evaluation (a job of one GPU per accuracy run: its start-up and one forward pass over
the test split), and input pipelines slower than the profile's rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from dtstudy.common.atomic_files import write_json
from dtstudy.config import run_kinds
from dtstudy.config.study_config import deep_merge, per_worker_batch, strategy_of, strategy_study
from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.perfmodel.machine import Machine, Stragglers, Workload
from dtstudy.projection import calibration, hardware, layer_profiles
from dtstudy.strategies.specs import SPECS, model_step

#: seconds each attempt of a job spends before its first step (assumed: Python and torch
#: imports, CUDA and NCCL set-up, the model, the data set's index; not measured on a cluster)
STARTUP_S = 120.0
#: the shortest time limit a job asks (minutes): a short run's start-up and its first
#: checkpoint's write vary more than the model says
TIME_LIMIT_FLOOR_MIN = 15
#: bytes per parameter of the gradients the model exchanges (fp32, as the study trains)
BYTES_PER_PARAMETER = 4
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Images:
    """The images a run trains and validates on, and where the count came from."""

    train: int
    val: int
    source: str


def split(available: int, dataset: dict, source: str) -> Images:
    """The training and validation splits of `available` training images, as prepare makes
    them: dataset.subset first, then round(val_fraction x n) held out for validation."""
    n = available if dataset["subset"] is None else dataset["subset"]
    val = round(dataset["val_fraction"] * n)
    return Images(n - val, val, source)


def images_from_meta(data_dir: str | Path) -> Images:
    """The prepared data set's split sizes (prepare's meta.json): what a run trains on."""
    path = Path(data_dir) / "meta.json"
    try:
        sizes = json.loads(path.read_text())["sizes"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"launcher.hardware: a job's time limit needs the prepared data's split sizes, "
            f"but {path} cannot be read ({err})"
        ) from None
    return Images(sizes["train"], sizes["val"], f"the prepared data set ({path})")


def study_images(config: dict, counted: int | None, why_not: str = "") -> Images:
    """The images of a study: `counted` (the data set on disk, before the validation split),
    else the config's launcher.budget_train_images; ConfigError naming that key without either."""
    if counted is not None:
        return split(counted, config["dataset"], f"the {config['dataset']['name']} data set on disk")
    given = config["launcher"]["budget_train_images"]
    if given is None:
        raise ConfigError(
            f"config key 'launcher.budget_train_images': null, and the data set cannot be counted "
            f"({why_not}); give its training images before the validation split "
            f"(ImageNet-1k: 1281167), or make the data set readable here"
        )
    return split(given, config["dataset"], "config key 'launcher.budget_train_images'")


# ----- a profile's compute ------------------------------------------------------------------


@dataclass(frozen=True)
class Costing:
    """A profile the study's model can be costed on: its machine and one GPU's rate."""

    profile: dict
    machine: Machine
    images_per_s: float

    @property
    def name(self) -> str:
        return self.profile["name"]


def costing(profile: dict, model: str, precision: str) -> Costing | str:
    """The Costing of a loaded profile for `model` trained at `precision` (train.precision), or
    why it cannot be costed (a line)."""
    rate = profile.get("train_images_per_s", {}).get(model, {}).get(precision)
    if rate is None:
        return f"no train_images_per_s.{model}.{precision} in the profile"
    if hardware.measured_here(profile):
        return "intra_node: measured (the communication benchmark runs with the study)"
    machine, _ = hardware.study_machine(profile)
    return Costing(profile, machine, float(rate))


def load_costing(name_or_path: str, config: dict, key: str) -> Costing:
    """costing() of a profile named by a config key for the study's model and precision;
    ConfigError naming the key when it cannot cost them."""
    model, precision = config["model"], config["train"]["precision"]
    found = costing(hardware.load_profile(name_or_path, key), model, precision)
    if isinstance(found, str):
        raise ConfigError(
            f"config key '{key}': profile {name_or_path!r} cannot cost model {model!r} at "
            f"train.precision {precision!r}: {found}; give the profile one GPU's training rate, "
            f"train_images_per_s: {{{model}: {{{precision}: images/s}}}} (config/hardware/README.md)"
        )
    return found


def workload(config: dict, images_per_s: float, workers: int) -> Workload:
    """One worker's workload at N = workers: the study's model from its layer profile, the
    compute of its step from the profile's rate (its batch: train.scaling's per-worker batch)."""
    model = config["model"]
    layers = layer_profiles.load(model, "config key 'model' (its layer profile, for the cost prediction)")
    matrices = layer_profiles.matrices(model, "config key 'model'")
    batch = per_worker_batch(config["train"], workers)
    tensors, groups = calibration.counts_for_onebit(layers)
    return Workload(
        parameters=sum(n * m for n, m in matrices),
        bytes_per_parameter=BYTES_PER_PARAMETER,
        batch=batch,
        compute_s=batch / images_per_s,
        tensors=tensors,
        column_groups=groups,
        matrices=calibration.as_matrices(matrices),
        layers=layers,
    )


# ----- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunCost:
    """One run's prediction (seconds), the GPUs it holds and its job's time limit; `seeds`:
    how many times the study runs it (its kind's seeds)."""

    kind: str
    strategy: str
    workers: int
    steps: int
    step_s: float
    train_s: float
    eval_s: float
    startup_s: float
    attempts: int
    wall_s: float
    gpus: int
    time_limit_min: int
    seeds: int = 1

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.gpus / SECONDS_PER_HOUR

    @property
    def gpu_hours_all_seeds(self) -> float:
        return self.gpu_hours * self.seeds

    def row(self) -> dict:
        return {**dataclasses.asdict(self), "gpu_hours": self.gpu_hours}


def run_params(config: dict, strategy: str, workers: int, profile: dict) -> dict:
    """The knobs the run trains with (the study's, defaults filled) and, for a parameter
    server, the profile's shard placement (a profile's key only)."""
    params = SPECS[strategy].check_params(config["strategy_params"].get(strategy, {}), workers)
    given = profile.get("strategy_params", {}).get(strategy, {})
    if "shards" in params:
        params["placement"] = given.get("placement", hardware.default("placement"))
    return params


def steps_per_epoch(config: dict, images: Images, workers: int) -> int:
    """One worker's batches of an epoch, as its DistributedSampler and BatchSampler count them."""
    return math.ceil(images.train / workers) // per_worker_batch(config["train"], workers)


def steps(config: dict, strategy: str, workers: int, images: Images, params: dict) -> int:
    """The steps of one worker of the run, as the training loop counts them."""
    train = config["train"]
    total = steps_per_epoch(config, images, workers) * train["epochs"]
    limits = [train["max_steps"], SPECS[strategy].step_limit(params)]
    return min([total] + [limit for limit in limits if limit is not None])


def eval_images(config: dict, images: Images, steps_done: int, workers: int) -> float:
    """Validation images one worker scores during the run: its 1/N share of each evaluation."""
    train = config["train"]
    per_epoch = steps_per_epoch(config, images, workers)
    epochs = min(train["epochs"], math.ceil(steps_done / per_epoch)) if per_epoch else 0
    points = steps_done // train["eval_every_steps"] if train.get("eval_every_steps") else None
    if points is not None or train["evals_per_epoch"] > 1:  # the grid's points, then the whole split once at the end
        grid = images.val if train["eval_images"] is None else min(train["eval_images"], images.val)
        scored = (points if points is not None else epochs * train["evals_per_epoch"]) * grid + images.val
    else:
        scored = epochs * images.val
    return scored / workers


def time_limit(wall_s: float, attempts: int, launcher: dict) -> int:
    """A job's time limit (minutes): the predicted wall time x time_limit_margin, at least the
    floor and past signal_delay_s (with SLURM's minute of early signalling), at most timeout_min;
    a run of more than one attempt asks timeout_min each time."""
    cap = launcher["timeout_min"]
    if attempts > 1:
        return cap
    floor = max(TIME_LIMIT_FLOOR_MIN, math.ceil(launcher["signal_delay_s"] / 60) + 2)
    return min(cap, max(floor, math.ceil(wall_s * launcher["time_limit_margin"] / 60)))


def run_cost(
    config: dict, strategy: str, workers: int, images: Images, where: Costing, stragglers: Stragglers | None = None
) -> RunCost:
    """One run of `config` (a run config, or kind_config's study config: its train section is the run's)."""
    params = run_params(config, strategy, workers, where.profile)
    load = workload(config, where.images_per_s, workers)
    step = model_step(
        strategy, load, where.machine, workers, params, stragglers or Stragglers.from_config(config.get("stragglers"))
    )
    count = steps(config, strategy, workers, images, params)
    forward_share = 1.0 - load.layers.backward_share
    eval_s = eval_images(config, images, count, workers) * forward_share / where.images_per_s
    work_s = count * step.step_s + eval_s
    launcher = config["launcher"]
    # attempts: how many time limits of timeout_min the run needs, each with its own start-up
    attempts = max(1, math.ceil((work_s + STARTUP_S) * launcher["time_limit_margin"] / (launcher["timeout_min"] * 60)))
    wall_s = work_s + STARTUP_S * attempts
    return RunCost(
        kind=run_kinds.kind_of_run_config(config),
        strategy=strategy,
        workers=workers,
        steps=count,
        step_s=step.step_s,
        train_s=count * step.step_s,
        eval_s=eval_s,
        startup_s=STARTUP_S * attempts,
        attempts=attempts,
        wall_s=wall_s,
        gpus=workers,
        time_limit_min=time_limit(wall_s, attempts, launcher),
    )


def kind_config(config: dict, kind: str) -> dict:
    """The study config as a run of `kind` sees it (a scaling run's step limit and timing)."""
    return deep_merge(config, run_kinds.run_config_changes(config, kind))


def study_costs(config: dict, images: Images, where: Costing) -> list[RunCost]:
    """Every (kind, strategy, N) of the study: the scaling runs, then the accuracy runs, each in
    the config's order; each carries its kind's number of seeds."""
    stragglers = Stragglers.from_config(config.get("stragglers"))
    costs = []
    for kind in run_kinds.kinds_run(config):
        seeds = len(run_kinds.seeds(config, kind))
        for name in config["strategies"]:
            # a variant (config `variants`) runs as its strategy under its own keys, at its own N;
            # a strategy with strategy_train under those
            arm = strategy_study(config, name)
            as_run, strategy = kind_config(arm, kind), strategy_of(config, name)
            costs += [
                dataclasses.replace(
                    run_cost(as_run, strategy, n, images, where, stragglers), seeds=seeds, strategy=name
                )
                for n in run_kinds.arm_workers(config, name, kind)
            ]
    return costs


def total_gpu_hours(costs: list[RunCost]) -> float:
    return sum(cost.gpu_hours_all_seeds for cost in costs)


# ----- the study's gates and its jobs' time limits ---------------------------------------------


def cluster_costing(config: dict) -> Costing | None:
    """The profile of the nodes a SLURM study runs on (launcher.hardware), checked against the
    launcher's nodes; None when the study is not on SLURM or names none."""
    launcher = config["launcher"]
    if not launch_backend(config).predicts_costs or launcher["hardware"] is None:
        return None
    where = load_costing(launcher["hardware"], config, "launcher.hardware")
    if where.machine.gpus_per_node != launcher["gpus_per_node"]:
        raise ConfigError(
            f"config key 'launcher.gpus_per_node': {launcher['gpus_per_node']}, but launcher.hardware "
            f"{launcher['hardware']!r} has {where.machine.gpus_per_node} GPUs per node; give the profile "
            f"of your nodes (a copy with its gpus_per_node and links) or set gpus_per_node to match"
        )
    return where


def check_study(config: dict, images: Images) -> None:
    """Before any job: with launcher.hardware, every run fits its requeues and the study fits
    launcher.gpu_hour_budget; a budget without a profile to predict on is refused."""
    launcher = config["launcher"]
    if not launch_backend(config).predicts_costs:
        return
    where = cluster_costing(config)
    if where is None:
        if launcher["gpu_hour_budget"] is not None:
            raise ConfigError(
                f"config key 'launcher.gpu_hour_budget': {launcher['gpu_hour_budget']:g} needs a "
                f"prediction to hold the study to; set launcher.hardware to the profile of your nodes"
            )
        return
    costs = study_costs(config, images, where)
    allowed = launcher["max_requeues"] + 1
    for cost in costs:
        if cost.attempts > allowed:
            raise ConfigError(
                f"config key 'launcher.max_requeues': {launcher['max_requeues']} requeues cannot finish "
                f"the {cost.kind} run of {cost.strategy} at N={cost.workers}: "
                f"predicted {cost.wall_s / SECONDS_PER_HOUR:.1f} h on "
                f"{where.name} x time_limit_margin {launcher['time_limit_margin']:g} needs {cost.attempts} jobs of "
                f"launcher.timeout_min {launcher['timeout_min']} min; raise max_requeues to {cost.attempts - 1} "
                f"or timeout_min"
            )
    total = total_gpu_hours(costs)
    budget = launcher["gpu_hour_budget"]
    if budget is not None and total > budget:
        dearest = max(config["strategies"], key=lambda s: sum(c.gpu_hours_all_seeds for c in costs if c.strategy == s))
        raise ConfigError(
            f"config key 'launcher.gpu_hour_budget': the study is predicted to cost {total:.0f} GPU-hours on "
            f"{where.name}, over the budget of {budget:g}; the cost grows with strategies, workers, seeds, "
            f"train.epochs (accuracy runs) and scaling.steps (scaling runs) (the dearest strategy: {dearest}); "
            "`python -m dtstudy budget` prints every run"
        )


def job_time_limit_min(config: dict, strategy: str, workers: int, data_dir: str | Path) -> int | None:
    """The time limit of a run's SLURM job from its prediction on launcher.hardware (the
    prepared data's sizes); None = launcher.timeout_min (not on SLURM, or no profile named)."""
    where = cluster_costing(config)
    if where is None:
        return None
    return run_cost(config, strategy, workers, images_from_meta(data_dir), where).time_limit_min


# ----- what the budget command and the study's start print ---------------------------------------


def profile_names(config: dict) -> list[tuple[str, str]]:
    """(profile, the config key naming it): launcher.hardware first, then the projection's."""
    names = []
    if config["launcher"]["hardware"] is not None:
        names.append((config["launcher"]["hardware"], "launcher.hardware"))
    names += [(name, "projection.hardware") for name in hardware.profile_names(config["projection"]["hardware"])]
    seen, out = set(), []
    for name, key in names:
        if hardware.profile_path(name).resolve() not in seen:
            seen.add(hardware.profile_path(name).resolve())
            out.append((name, key))
    return out


def report(config: dict, images: Images) -> dict:
    """The prediction on every profile the config names that can cost its model: per run,
    per strategy and in total (the budget command's record), and why any other is skipped."""
    kinds = {
        kind: {
            "runs": run_kinds.run_count(config, kind),
            "workers": run_kinds.workers(config, kind),
            "seeds": run_kinds.seeds(config, kind),
            "gives": run_kinds.KINDS[kind].gives,
        }
        for kind in run_kinds.kinds_run(config)
    }
    if run_kinds.has_scaling_runs(config):
        kinds[run_kinds.SCALING].update(
            warmup_steps=config["scaling"]["warmup_steps"], steps=config["scaling"]["steps"]
        )
    out = {
        "model": config["model"],
        "precision": config["train"]["precision"],
        "runs": sum(kind["runs"] for kind in kinds.values()),
        "kinds": kinds,
        "train_images": images.train,
        "val_images": images.val,
        "images_from": images.source,
        "startup_s": STARTUP_S,
        "time_limit_margin": config["launcher"]["time_limit_margin"],
        "time_limit_floor_min": TIME_LIMIT_FLOOR_MIN,
        "timeout_min": config["launcher"]["timeout_min"],
        "profiles": {},
        "skipped": {},
    }
    for name, key in profile_names(config):
        where = costing(hardware.load_profile(name, key), config["model"], config["train"]["precision"])
        if isinstance(where, str):
            out["skipped"][name] = where
            continue
        costs = study_costs(config, images, where)
        longest = max(costs, key=lambda c: c.wall_s)
        out["profiles"][where.name] = {
            "named_by": key,
            "images_per_s": where.images_per_s,
            "gpus_per_node": where.machine.gpus_per_node,
            "total_gpu_hours": total_gpu_hours(costs),
            "by_kind_gpu_hours": {kind: total_gpu_hours([c for c in costs if c.kind == kind]) for kind in kinds},
            "by_strategy_gpu_hours": {
                s: total_gpu_hours([c for c in costs if c.strategy == s]) for s in config["strategies"]
            },
            "longest_run": {
                "kind": longest.kind,
                "strategy": longest.strategy,
                "workers": longest.workers,
                "hours": longest.wall_s / SECONDS_PER_HOUR,
            },
            "runs": [cost.row() for cost in costs],
        }
    return out


def _hours(seconds: float) -> str:
    return f"{seconds / SECONDS_PER_HOUR:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def render(result: dict, budget: float | None = None) -> str:
    """The report as text: a table per profile (one line per kind, strategy and N; each of the
    kind's seeds runs it once)."""
    kinds = "; ".join(
        f"{kind['runs']} {name} runs ({len(kind['seeds'])} seed{'s' * (len(kind['seeds']) != 1)} each, {kind['gives']})"
        for name, kind in result["kinds"].items()
    )
    lines = [
        f"Predicted cost of the study: {kinds}; of {result['model']} at {result['precision']} "
        f"on {result['train_images']} training and {result['val_images']} validation images "
        f"({result['images_from']}); start-up {result['startup_s']:g} s per job attempt (assumed), "
        f"time limit = prediction x {result['time_limit_margin']:g}"
    ]
    for name, profile in result["profiles"].items():
        lines += [
            "",
            f"{name} ({profile['named_by']}): {profile['images_per_s']:g} images/s per GPU at N=1, "
            f"{profile['gpus_per_node']} GPUs per node",
            f"{'kind':<10}{'strategy':<20}{'N':>4}{'steps':>9}{'step':>10}{'wall':>11}{'GPUs':>6}{'GPU-h/run':>11}"
            f"{'limit':>9}{'jobs':>6}",
        ]
        for run in profile["runs"]:
            lines.append(
                f"{run['kind']:<10}{run['strategy']:<20}{run['workers']:>4}{run['steps']:>9}"
                f"{run['step_s'] * 1000:>8.1f}ms"
                f"{_hours(run['wall_s']):>11}{run['gpus']:>6}{run['gpu_hours']:>11.2f}"
                f"{run['time_limit_min']:>5} min{run['attempts']:>6}"
            )
        per = ", ".join(f"{s} {h:.0f}" for s, h in profile["by_strategy_gpu_hours"].items())
        per_kind = ", ".join(f"{kind} runs {h:.0f}" for kind, h in profile["by_kind_gpu_hours"].items())
        longest = profile["longest_run"]
        lines += [
            f"GPU-hours per strategy (all kinds, N and seeds): {per}",
            f"GPU-hours per kind of run: {per_kind}",
            f"total: {profile['total_gpu_hours']:.0f} GPU-hours on {name}; the longest run "
            f"{longest['strategy']} at N={longest['workers']} ({longest['kind']}), {longest['hours']:.1f} h",
        ]
        if budget is not None and profile["named_by"] == "launcher.hardware":
            lines.append(
                f"launcher.gpu_hour_budget: {budget:g} GPU-hours "
                + ("(over it: the study is refused)" if profile["total_gpu_hours"] > budget else "(within it)")
            )
    for name, why in result["skipped"].items():
        lines += ["", f"{name}: not costed, {why}"]
    if not result["profiles"]:
        lines += [
            "",
            f"no profile of launcher.hardware or projection.hardware can cost {result['model']} at "
            f"{result['precision']}: give one train_images_per_s.{result['model']}.{result['precision']} "
            f"(config/hardware/README.md)",
        ]
    return "\n".join(lines)


# ----- the budget command's overrides and record -------------------------------------------------


def overrides(settings: list[str]) -> dict:
    """`KEY=VALUE` settings (a dotted key, a YAML value) as a config overlay; ConfigError on a malformed one."""
    overlay: dict = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {setting!r}: give KEY=VALUE, e.g. train.precision=fp32")
        *parents, last = key.split(".")
        node = overlay
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return overlay


def write_record(path: str | Path, name: str, configs: list[str], settings: list[str], result: dict) -> None:
    """The prediction as entry `name` of a JSON record (others kept), with what reproduces it."""
    path = Path(path)
    record = json.loads(path.read_text()) if path.exists() else {}
    record["about"] = (
        "the cost of a study as the performance model predicts it (dtstudy.projection.budget), "
        "per hardware profile; each entry's command reproduces it, and tests/test_budget.py "
        "recomputes every entry"
    )
    command = ["python -m dtstudy budget", *(f"--configfile {c}" for c in configs[1:])]
    command += [f"--set {s}" for s in settings]
    record[name] = {"command": " ".join(command), "configs": configs, "set": list(settings), **result}
    write_json(path, record)
