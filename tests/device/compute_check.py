"""The compute check on one GPU (tests/device/README.md): ResNet-50 in bf16 from a generated JPEG
tree through the study's own path against a loop written as torchvision's classification
reference trains (same batch, AMP, channels_last, same loader workers, the study's decoder),
in the same run; then every strategy's exchange at N = 2 on the GPU (exchange_check).

    python3 tests/device/compute_check.py --out DIR            # on a GPU machine (compute_check.sh)
    python3 tests/device/compute_check.py --out DIR --dry-run  # anywhere: the same steps on the CPU, tiny

It passes when, on the GPU: the study's run started as a cluster task starts (a fresh
submitit task, not pinned to cores); its images/s are >= 0.95 of the reference's (the mean
of a reference run before and one after the study's, both decoding with torchvision.io as
the study does; a PIL-decoding run is reported beside them); data_s is under 5% of a step
(data + step); data + compute + communication seconds of every step of an epoch sum to
within 5% of that epoch timed from outside with CUDA events; the study's test pass
(`dtstudy evaluate`) runs on the GPU; a straggler's delay adds at least 0.9 of itself to
queued GPU work on the study's clock (CudaClock.sleep); and every strategy of
config/cluster.yaml completes N = 2 on the GPU over gloo with no tensor off the GPU handed to
a group NCCL would carry. DIR/compute_check.json is written after every step, so a time-out
keeps what was measured; it is the record docs/testing.md quotes once kept in docs/records/.
The dry run checks that every step works apart from CUDA (in fp32: bf16 on a CPU without
bf16 units is emulated, twenty times slower); its figures say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # exchange_check, also in the forkserver's ranks

import exchange_check  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from dtstudy.common.atomic_files import write_json  # noqa: E402
from dtstudy.config.study_config import deep_merge, read_yaml, run_config, validate_schema  # noqa: E402
from dtstudy.runspec import RunSpec  # noqa: E402

MIN_RATIO, MAX_DATA_SHARE, MAX_SUM_ERROR, MIN_DELAY_SHARE = 0.95, 0.05, 0.05, 0.9
BUDGET_S = 510  # compute_check.sh stops the check at 540 s: the device machine lends 15 minutes in all
EXCHANGE_STEPS = 4  # each strategy's N = 2 run
EXCHANGE_LIMIT_S, MIN_EXCHANGE_S = 240, 20  # the longest one may take; less time left: skipped
CLASSES = 10
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's ImageNet normalisation


def _write_jpeg(args) -> None:
    path, label, seed, size = args
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = size
    # smooth class-tinted gradients and mild noise: decodes like a photo, not like white noise
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack(
        [np.sin((c + 1 + label) * 3 * x + rng.uniform(0, 6)) * np.cos((c + 2) * 2 * y) for c in range(3)], -1
    )
    pixels = (127 + 100 * base + rng.normal(0, 12, (height, width, 3))).clip(0, 255).astype("uint8")
    Image.fromarray(pixels).save(path, quality=90)


def jpeg_tree(root: Path, train_images: int, val_images: int, size: tuple[int, int]) -> Path:
    """root/train/<class>/*.jpg and root/val/<class>/*.jpg (val: the study's test split)."""
    jobs = []
    for split, count in (("train", train_images), ("val", val_images)):
        for i in range(count):
            label = i % CLASSES
            folder = root / split / f"class{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{i:06d}.jpg", label, 2 * i + (split == "val"), size))
    with Pool(max(1, (os.cpu_count() or 2) - 1)) as pool:
        pool.map(_write_jpeg, jobs, chunksize=64)
    return root


def cluster_config() -> dict:
    """config/config.yaml + config/cluster.yaml, as `snakemake --profile slurm` merges them."""
    return deep_merge(read_yaml(REPO / "config" / "config.yaml"), read_yaml(REPO / "config" / "cluster.yaml"))


def checked(config: dict) -> dict:
    from dtstudy.checks import check_config

    config = validate_schema(config)
    check_config(config)
    return config


def val_fraction(dry: bool) -> float:
    """The cluster's share of validation images; the dry run's tiny tree needs more for one."""
    return 0.1 if dry else 0.02


def study_config(root: Path, dry: bool, steps: int, skip: int) -> dict:
    """What the cluster study computes with (precision, kernels, batch, loader), on the
    generated tree, one GPU, one run of `steps` steps, started as a cluster task starts: one
    fresh submitit task (launcher.local_processes: tasks), which nothing pins to cores."""
    config = cluster_config()
    overrides = {
        "dataset": {"root": str(root), "subset": None, "val_fraction": val_fraction(dry)},
        "strategies": ["allreduce"],
        "workers": [1],
        "seeds": [0],
        # one run of `steps` steps at N=1 (train.max_steps below), not the study's two kinds of run
        "scaling": {"steps": None, "seeds": None, "workers": None},
        "accuracy": {"workers": [1], "seeds": None},
        "train": {
            "epochs": 1,
            "max_steps": steps,
            "steady_state_skip": skip,
            "log_every": 50,
            "checkpoint_every_min": None,
            "evals_per_epoch": 1,
            "eval_images": None,
        },
        "launcher": {
            "cluster": "local",
            "local_processes": "tasks",
            "device": "cpu" if dry else "cuda",
            "timeout_min": 20,
        },
        "tracking": {"uri": None},
    }
    # the loader's workers as a cluster task has them (cpus_per_task - 1 per GPU), fixed here so
    # that the study's run and the reference get the same number on any machine
    overrides["loader"] = {"workers": max(0, config["launcher"]["cpus_per_task"] - 1)}
    if dry:  # tiny images and batches, fp32: the same steps in seconds on a CPU
        overrides["dataset"]["image_size"] = 32
        overrides["train"].update(batch_size=4, precision="fp32")
        overrides["loader"] = {"workers": 1}
    return checked(deep_merge(config, overrides))


def exchange_config(config: dict, dry: bool) -> dict:
    """The check's config for every strategy of config/cluster.yaml at N = 2: a few steps,
    local SGD's and EASGD's averages every 2 steps (their default period is 8), a ResNet-18
    (ResNet-50's layers, BatchNorm and channels_last included, at a fraction of its start-up
    and of the bytes gloo stages through host memory: the 13 runs must fit the check's time)."""
    overrides = {
        "strategies": cluster_config()["strategies"],
        "workers": [2],
        "accuracy": {"workers": [2]},
        "model": "resnet18",
        "train": {
            "max_steps": EXCHANGE_STEPS,
            "steady_state_skip": 1,
            "log_every": 1,
            "eval_images": 2 * config["train"]["batch_size"],
        },
        "strategy_params": {"local_sgd": {"period": 2}, "easgd": {"period": 2}},
        "loader": {"workers": 0 if dry else 2},
    }
    return checked(deep_merge(config, overrides))


def exchange_runs(config: dict) -> list[tuple[str, str, dict]]:
    """(label, strategy, run config): every strategy of the cluster study with its defaults,
    and gossip's random pairing (its own broadcast at setup)."""
    runs = [(name, name, run_config(config, name)) for name in config["strategies"]]
    if "gossip" in config["strategies"]:
        random_pairs = deep_merge(config, {"strategy_params": {"gossip": {"topology": "random_pairs"}}})
        runs.append(("gossip_random_pairs", "gossip", run_config(checked(random_pairs), "gossip")))
    return runs


class Clock:
    """CUDA events on a GPU, the host's clock on the CPU (as the study's timing)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


def read_rgb(path: str) -> torch.Tensor:
    """An image file as uint8 RGB [3, H, W], decoded by torchvision.io (libjpeg-turbo), the
    call the study's torchvision decoder makes (dtstudy.data.decoding.decode_torchvision)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def reference_loop(
    config: dict, root: Path, device: torch.device, steps: int, skip: int, workers: int, decoder: str
) -> tuple[float, str]:
    """Images/s of the steps after `skip`, trained as torchvision's references/classification
    train.py does with --amp (bf16 here, as the study) and --channels-last: ImageFolder + its
    preset (RandomResizedCrop, flip, float, Normalize), a DataLoader with pinned memory, cuDNN
    autotuning, SGD. `decoder`: "torchvision" decodes with torchvision.io, as the study does (the
    reference's --backend tensor), "pil" with PIL (ImageFolder's default loader). Without the
    reference's per-step loss.item(), a stricter baseline. Returns the images/s and the
    function that decoded (module.name)."""
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import transforms as T

    train = config["train"]
    size = config["dataset"]["image_size"]
    to_tensor = [T.PILToTensor()] if decoder == "pil" else []
    preset = T.Compose(
        [
            *to_tensor,
            T.RandomResizedCrop(size, antialias=True),
            T.RandomHorizontalFlip(),
            T.ConvertImageDtype(torch.float),
            T.Normalize(MEAN, STD),
        ]
    )
    loader = {"pil": torchvision.datasets.folder.default_loader, "torchvision": read_rgb}[decoder]
    data = torchvision.datasets.ImageFolder(str(root / "train"), preset, loader=loader)
    cuda = device.type == "cuda"
    batches_of = DataLoader(
        data,
        batch_size=train["batch_size"],
        shuffle=True,
        num_workers=workers,
        pin_memory=cuda,
        drop_last=True,
        persistent_workers=workers > 0,
    )
    layout = torch.channels_last if cuda else torch.preserve_format
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=len(data.classes)).to(device, memory_format=layout)
    torch.backends.cudnn.benchmark = True
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=train["momentum"], weight_decay=train["weight_decay"]
    )
    criterion = torch.nn.CrossEntropyLoss()
    clock, batches, start = Clock(device), iter(batches_of), None
    for step in range(steps):
        if step == skip:
            start = clock.mark()
        try:
            inputs, labels = next(batches)
        except StopIteration:
            batches = iter(batches_of)
            inputs, labels = next(batches)
        inputs = inputs.to(device, non_blocking=True, memory_format=layout)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train["precision"] == "bf16"):
            loss = criterion(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    seconds = clock.seconds(start, clock.mark())
    return (steps - skip) * train["batch_size"] / seconds, f"{loader.__module__}.{loader.__name__}"


def run_dtstudy(*args: str) -> None:
    """`python3 -m dtstudy ARGS` from the repository's source, the carried packages' path kept."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "workflow"), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([sys.executable, "-m", "dtstudy", *args], check=True, cwd=REPO, env=env)


def study_run(config_path: Path, data: Path, out: Path) -> dict:
    """The study's own path: `python3 -m dtstudy train` (submitit, the launcher, the loop)."""
    run_dtstudy(
        "train",
        "--config",
        str(config_path),
        "--strategy",
        "allreduce",
        "--workers",
        "1",
        "--seed",
        "0",
        "--data",
        str(data),
        "--out",
        str(out),
        "--no-tracking",
    )
    return json.loads((out / "metrics.json").read_text())


def epoch_sums(config: dict, data: Path, out: Path, device: torch.device) -> list[dict]:
    """The study's training loop in this process, each epoch timed from outside on the device's
    clock, beside the sum of its steps' data + compute + communication seconds."""
    import torch.distributed as dist

    from dtstudy.runspec import RunSpec
    from dtstudy.strategies.base import DistContext
    from dtstudy.training import loop

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out.parent / 'rendezvous'}", rank=0, world_size=1)
    clock, epochs, original = Clock(device), [], loop.train_one_epoch

    def bracketed(run, state, epoch, start):
        before = len(state.log.step_s)
        begin = clock.mark()
        original(run, state, epoch, start)
        outside = clock.seconds(begin, clock.mark())
        log = state.log
        parts = {key: sum(getattr(log, key)[before:]) for key in ("data_s", "step_s", "comm_s")}
        epochs.append(
            {
                "steps": len(log.step_s) - before,
                "events_s": outside,
                "data_s": parts["data_s"],
                "compute_s": parts["step_s"] - parts["comm_s"],
                "comm_s": parts["comm_s"],
                "sum_s": parts["data_s"] + parts["step_s"],
            }
        )

    loop.train_one_epoch = bracketed
    try:
        spec = RunSpec("allreduce", 1, 0, run_config(config, "allreduce"), str(data), str(out))
        ctx = DistContext(rank=0, world_size=1, workers=1, local_rank=0, device=device, backend=backend)
        loop.train_worker(spec, ctx)
    finally:
        loop.train_one_epoch = original
        dist.destroy_process_group()
    return epochs


def straggler_delay(device: torch.device, delay_s: float = 0.03, repeats: int = 5) -> dict:
    """A straggler's delay on the device's timeline (dtstudy.common.timing's clock.sleep,
    as the training loop spends it): device work queued, then the delay, timed with the
    study's own clock against the same work alone. A host-only sleep would overlap the queued
    work and add (almost) nothing. The fastest of `repeats` of each, interleaved: another
    process on a shared machine only ever adds time. On the CPU (the dry run) the work is
    small, so that a busy machine's noise on it stays well under the delay."""
    from dtstudy.common.timing import clock_for

    clock = clock_for(device)
    size = 64 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device)

    def work(delay: float | None) -> float:
        start = clock.mark()
        for _ in range(20):
            a @ a
        if delay is not None:
            clock.sleep(delay)
        return clock.seconds(start, clock.mark())

    work(None)  # warm-up
    alone, delayed = zip(*((work(None), work(delay_s)) for _ in range(repeats)))
    return {
        "delay_s": delay_s,
        "work_alone_s": min(alone),
        "work_and_delay_s": min(delayed),
        "added_s": min(delayed) - min(alone),
    }


def evaluation(run: Path, data: Path, out: Path) -> dict:
    """The study's test pass (`python3 -m dtstudy evaluate`, the evaluate rule's command) on the run's model."""
    run_dtstudy("evaluate", "--run", str(run), "--data", str(data), "--out", str(out))
    result = json.loads(out.read_text())
    return {key: result[key] for key in ("top1", "test_images", "seconds")} | {
        "device_type": result["environment"]["device_type"],
        "devices": result["environment"]["devices"],
    }


def started_unpinned(metrics: dict) -> dict:
    """How the study's run started: its ranks' pinned cores (None: none) and rank 0's cores,
    against this process's (what a cluster task's scheduler gave the check)."""
    environment = metrics["environment"]
    return {
        "local_processes": metrics["config"]["launcher"]["local_processes"],
        "pinned_cores": environment["pinned_cores"],
        "rank0_cores": len(environment["affinity"]),
        "check_cores": len(os.sched_getaffinity(0)),
    }


def verdicts(record: dict) -> dict:
    """Each check: True, False, or None where its figures are not measured (yet)."""
    has = lambda *keys: all(record.get(key) is not None for key in keys)  # noqa: E731
    exchanges = record.get("exchange_n2")
    return {
        "study_run_started_unpinned": (
            record["start"]["pinned_cores"] is None and record["start"]["rank0_cores"] == record["start"]["check_cores"]
        )
        if has("start")
        else None,
        "images_per_s_ratio_at_least_0.95": record["images_per_s_ratio"] >= MIN_RATIO
        if has("images_per_s_ratio")
        else None,
        "data_share_under_0.05": record["data_share_of_step"] < MAX_DATA_SHARE if has("data_share_of_step") else None,
        "step_parts_sum_to_events_within_0.05": record["step_parts_sum_error"] <= MAX_SUM_ERROR
        if has("step_parts_sum_error")
        else None,
        "test_pass_on_the_runs_device": record["evaluation"]["device_type"] == record["device_type"]
        if has("evaluation")
        else None,
        "straggler_delay_on_the_device_timeline": record["straggler_delay"]["added_s"]
        >= MIN_DELAY_SHARE * record["straggler_delay"]["delay_s"]
        if has("straggler_delay")
        else None,
        "n2_exchange_on_the_device_for_every_strategy": all(
            run["completed"] and not run["off_device"] for run in exchanges
        )
        if exchanges is not None and len(exchanges) == record["exchange_runs_planned"]
        else None,
    }


class Record:
    """compute_check.json, written again after every step (atomically): a check stopped by its
    time limit leaves what it measured, the checks it could decide and `complete: false`."""

    def __init__(self, path: Path, **fields):
        self.path, self.fields = path, {**fields, "complete": False}
        self.started = time.perf_counter()
        self.update()

    def update(self, **fields) -> None:
        self.fields.update(fields)
        checks = verdicts(self.fields)
        self.fields.update(
            checks=checks,
            passed=all(value is True for value in checks.values()),
            seconds=round(time.perf_counter() - self.started, 1),
        )
        write_json(self.path, self.fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for compute_check.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/compute_check"), help="scratch folder")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny: that every step works")
    parser.add_argument("--steps", type=int, help="steps per run (default 300 on a GPU, 4 dry)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"the N = 2 exchanges still to run when this is spent are recorded as skipped "
        f"(default {BUDGET_S} s on a GPU, none dry)",
    )
    args = parser.parse_args()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(1)  # as the study's CPU ranks: a shared machine's cores are not oversubscribed
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --dry-run on a machine without one")
    deadline = time.monotonic() + (args.budget_s or (float("inf") if dry else BUDGET_S))
    steps = args.steps or (4 if dry else 300)
    skip = 1 if dry else 50
    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    batch = 4 if dry else int(read_yaml(REPO / "config" / "cluster.yaml")["train"]["batch_size"])
    # enough images for one epoch of `steps` steps at N = 1, and of the exchanges' at N = 2,
    # after the validation share is held out
    train_images = max(steps, 2 * EXCHANGE_STEPS) * batch
    root = jpeg_tree(
        work / "jpeg", int(train_images / (1 - val_fraction(dry))) + batch, 2 * batch, (80, 96) if dry else (375, 500)
    )
    config = study_config(root, dry, steps, skip)
    config_path = work / "study.yaml"
    config_path.write_text(yaml.safe_dump(config))
    data = work / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    subprocess.run(
        [sys.executable, "-m", "dtstudy", "prepare-data", "--config", str(config_path), "--out", str(data)],
        check=True,
        cwd=REPO,
        env=env,
    )
    workers = config["loader"]["workers"]
    exchanges_config = exchange_config(config, dry)
    planned = exchange_runs(exchanges_config)
    record = Record(
        args.out / "compute_check.json",
        what=(
            "ResNet-50, bf16 autocast, channels_last, cuDNN autotuning: the study's allreduce at N=1 "
            "(python3 -m dtstudy train as one fresh submitit task, config/cluster.yaml on a generated JPEG "
            "tree) against a torchvision-reference-style loop with the same batch, loader workers and "
            "decoder (torchvision.io; PIL beside it); then every cluster strategy at N=2 on the one "
            "device over gloo"
        ),
        command="bash tests/device/compute_check.sh" + (" --dry-run" if dry else ""),
        dry_run=dry,
        device_type=device.type,
        device=torch.cuda.get_device_name(0) if not dry else "cpu",
        torch=torch.__version__,
        python=sys.version.split()[0],
        batch_size=config["train"]["batch_size"],
        image_size=config["dataset"]["image_size"],
        precision=config["train"]["precision"],
        loader_workers=workers,
        steps=steps,
        steady_state_skip=skip,
        study_decoder=config["loader"]["decoder"],
        exchange_runs_planned=len(planned),
    )

    # interleaved: the reference before and after the study's run, so that a drift of the
    # machine's speed shows as a spread of the reference rather than as the study's ratio
    rate, decoded_by = reference_loop(config, root, device, steps, skip, workers, "torchvision")
    references = [rate]
    record.update(reference_images_per_s=references, reference_decoder=decoded_by)
    metrics = study_run(config_path, data, work / "run")
    step = metrics["step_time"]
    record.update(
        start=started_unpinned(metrics),
        compute=metrics.get("compute"),
        kernels=metrics["environment"].get("kernels"),
        study_images_per_s=metrics["throughput"],
        study_images_per_s_median_window=metrics["throughput_median"],
        study_step_time_s=step,
        data_share_of_step=step["data_s"] / (step["total_s"] + step["data_s"]),
    )
    references.append(reference_loop(config, root, device, steps, skip, workers, "torchvision")[0])
    reference = sum(references) / len(references)
    record.update(reference_images_per_s=references, images_per_s_ratio=metrics["throughput"] / reference)
    pil, decoded_by = reference_loop(config, root, device, steps, skip, workers, "pil")
    record.update(
        reference_pil_images_per_s=pil,
        reference_beside_decoder=decoded_by,
        images_per_s_ratio_to_pil_reference=metrics["throughput"] / pil,
    )
    epochs = epoch_sums(config, data, work / "inprocess", device)
    record.update(
        epochs_timed_outside=epochs,
        step_parts_sum_error=max(abs(e["sum_s"] - e["events_s"]) / e["events_s"] for e in epochs),
    )
    record.update(evaluation=evaluation(work / "run", data, work / "eval.json"))
    record.update(straggler_delay=straggler_delay(device))

    context, exchanges = exchange_check.forkserver(), []
    for label, strategy, run_cfg in planned:
        left_s = min(deadline - time.monotonic(), EXCHANGE_LIMIT_S)  # a hung run is stopped
        if left_s < MIN_EXCHANGE_S:
            exchanges.append(
                {"strategy": label, "completed": False, "skipped": "the check's time budget is spent", "off_device": {}}
            )
        else:
            spec = RunSpec(strategy, 2, 0, run_cfg, str(data), str(work / "exchange" / label))
            exchanges.append(
                exchange_check.run_strategy(
                    context, label, spec, device.type, work / "exchange" / label / "logs", left_s
                )
            )
        record.update(exchange_n2=exchanges)
    record.update(complete=True)
    print(
        json.dumps(
            {
                key: record.fields[key]
                for key in (
                    "device",
                    "start",
                    "reference_images_per_s",
                    "reference_pil_images_per_s",
                    "study_images_per_s",
                    "images_per_s_ratio",
                    "data_share_of_step",
                    "step_parts_sum_error",
                    "evaluation",
                    "straggler_delay",
                    "checks",
                    "passed",
                )
            },
            indent=2,
        )
    )
    for run in exchanges:
        print(
            f"N=2 {run['strategy']:22s} {'completed' if run['completed'] else 'FAILED'} "
            f"{run.get('seconds', '-')} s  off the device: {run['off_device'] or 'none'}  "
            f"{run.get('errors') or run.get('skipped') or ''}"
        )
    return 0 if dry or record.fields["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
