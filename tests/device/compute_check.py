"""The compute check on one GPU (tests/device/README.md): ResNet-50 in bf16 from a generated JPEG
tree through the study's own path against a loop written as torchvision's classification
reference trains (same batch, AMP, channels_last, same loader workers), in the same run.

    python3 tests/device/compute_check.py --out DIR            # on a GPU machine (compute_check.sh)
    python3 tests/device/compute_check.py --out DIR --dry-run  # anywhere: the same steps on the CPU, tiny

It passes when, on the GPU: the study's images/s are >= 0.95 of the reference's (the mean of a
reference run before and one after the study's); data_s is under 5% of a step (data + step);
data + compute + communication seconds of every step of an epoch sum to within 5% of
that epoch timed from outside with CUDA events; the study's test pass (`dtstudy evaluate`)
runs on the GPU; and a straggler's delay adds at least 0.9 of itself to queued GPU work on
the study's clock (CudaClock.sleep). Figures and verdicts go to
DIR/compute_check.json, the record docs/testing.md quotes once it is kept in docs/records/.
The dry run checks that every step works apart from CUDA; its figures say nothing.
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

import torch  # noqa: E402
import yaml  # noqa: E402

from dtstudy.config.study_config import deep_merge, read_yaml, run_config, validate_schema  # noqa: E402

MIN_RATIO, MAX_DATA_SHARE, MAX_SUM_ERROR = 0.95, 0.05, 0.05
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
    base = np.stack([np.sin((c + 1 + label) * 3 * x + rng.uniform(0, 6)) * np.cos((c + 2) * 2 * y) for c in range(3)], -1)
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


def study_config(root: Path, dry: bool, steps: int, skip: int) -> dict:
    """config/config.yaml + config/cluster.yaml (precision, kernels, batch, loader: what the
    cluster study computes with), on the generated tree, one GPU, one run of `steps` steps."""
    config = deep_merge(read_yaml(REPO / "config" / "config.yaml"), read_yaml(REPO / "config" / "cluster.yaml"))
    overrides = {
        "dataset": {"root": str(root), "subset": None, "val_fraction": 0.02},
        "strategies": ["allreduce"], "workers": [1], "seeds": [0],
        # one run of `steps` steps at N=1 (train.max_steps below), not the study's two kinds of run
        "scaling": {"steps": None, "seeds": None, "workers": None}, "accuracy": {"workers": [1], "seeds": None},
        "train": {"epochs": 1, "max_steps": steps, "steady_state_skip": skip, "log_every": 50,
                  "checkpoint_every_min": None, "evals_per_epoch": 1, "eval_images": None},
        "launcher": {"cluster": "local", "device": "cpu" if dry else "cuda", "timeout_min": 20},
        "tracking": {"uri": None},
    }
    # the loader's workers as a cluster task has them (cpus_per_task - 1 per GPU), fixed here so
    # that the study's run (which a local launcher may pin to fewer cores) and the reference get
    # the same number
    overrides["loader"] = {"workers": max(0, config["launcher"]["cpus_per_task"] - 1)}
    if dry:  # tiny images and batches: the same steps in seconds on a CPU
        overrides["dataset"]["image_size"] = 64
        overrides["train"]["batch_size"] = 4
        overrides["loader"] = {"workers": 1}
    config = validate_schema(deep_merge(config, overrides))
    from dtstudy.checks import check_config

    check_config(config)
    return config


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


def reference_loop(config: dict, root: Path, device: torch.device, steps: int, skip: int, workers: int) -> float:
    """Images/s of the steps after `skip`, trained as torchvision's references/classification
    train.py does with --amp (bf16 here, as the study) and --channels-last: ImageFolder + its
    preset (RandomResizedCrop, flip, PILToTensor, float, Normalize), a DataLoader with pinned
    memory, cuDNN autotuning, SGD. Without the reference's per-step loss.item(), a stricter baseline."""
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import transforms as T

    train = config["train"]
    size = config["dataset"]["image_size"]
    preset = T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor(),
                        T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)])
    data = torchvision.datasets.ImageFolder(str(root / "train"), preset)
    cuda = device.type == "cuda"
    loader = DataLoader(data, batch_size=train["batch_size"], shuffle=True, num_workers=workers, pin_memory=cuda,
                        drop_last=True, persistent_workers=workers > 0)
    layout = torch.channels_last if cuda else torch.preserve_format
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=len(data.classes)).to(device, memory_format=layout)
    torch.backends.cudnn.benchmark = True
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=train["momentum"],
                                weight_decay=train["weight_decay"])
    criterion = torch.nn.CrossEntropyLoss()
    clock, batches, start = Clock(device), iter(loader), None
    for step in range(steps):
        if step == skip:
            start = clock.mark()
        try:
            inputs, labels = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, labels = next(batches)
        inputs = inputs.to(device, non_blocking=True, memory_format=layout)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = criterion(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    seconds = clock.seconds(start, clock.mark())
    return (steps - skip) * train["batch_size"] / seconds


def run_dtstudy(*args: str) -> None:
    """`python3 -m dtstudy ARGS` from the repository's source, the carried packages' path kept."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "workflow"), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "dtstudy", *args], check=True, cwd=REPO, env=env)


def study_run(config_path: Path, data: Path, out: Path) -> dict:
    """The study's own path: `python3 -m dtstudy train` (submitit, the launcher, the loop)."""
    run_dtstudy("train", "--config", str(config_path), "--strategy", "allreduce", "--workers", "1", "--seed", "0",
                "--data", str(data), "--out", str(out), "--no-tracking")
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
        epochs.append({"steps": len(log.step_s) - before, "events_s": outside, "data_s": parts["data_s"],
                       "compute_s": parts["step_s"] - parts["comm_s"], "comm_s": parts["comm_s"],
                       "sum_s": parts["data_s"] + parts["step_s"]})

    loop.train_one_epoch = bracketed
    try:
        spec = RunSpec("allreduce", 1, 0, run_config(config, "allreduce"), str(data), str(out))
        ctx = DistContext(rank=0, world_size=1, workers=1, local_rank=0, device=device, backend=backend)
        loop.train_worker(spec, ctx)
    finally:
        loop.train_one_epoch = original
        dist.destroy_process_group()
    return epochs


def straggler_delay(device: torch.device, delay_s: float = 0.03) -> dict:
    """A straggler's delay on the device's timeline (dtstudy.strategies.timing's clock.sleep,
    as the training loop spends it): device work queued, then the delay, timed with the
    study's own clock against the same work alone. A host-only sleep would overlap the queued
    work and add (almost) nothing."""
    from dtstudy.strategies.timing import clock_for

    clock = clock_for(device)
    size = 256 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device)

    def work(delay: float | None) -> float:
        start = clock.mark()
        for _ in range(20):
            a @ a
        if delay is not None:
            clock.sleep(delay)
        return clock.seconds(start, clock.mark())

    work(None)  # warm-up
    alone, delayed = work(None), work(delay_s)
    return {"delay_s": delay_s, "work_alone_s": alone, "work_and_delay_s": delayed, "added_s": delayed - alone}


def evaluation(run: Path, data: Path, out: Path) -> dict:
    """The study's test pass (`python3 -m dtstudy evaluate`, the evaluate rule's command) on the run's model."""
    run_dtstudy("evaluate", "--run", str(run), "--data", str(data), "--out", str(out))
    result = json.loads(out.read_text())
    return {key: result[key] for key in ("top1", "test_images", "seconds")} | {
        "device_type": result["environment"]["device_type"], "devices": result["environment"]["devices"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for compute_check.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/compute_check"), help="scratch folder")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny: that every step works")
    parser.add_argument("--steps", type=int, help="steps per run (default 300 on a GPU, 6 dry)")
    args = parser.parse_args()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(1)  # as the study's CPU ranks: a shared machine's cores are not oversubscribed
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --dry-run on a machine without one")
    steps = args.steps or (6 if dry else 300)
    skip = 2 if dry else 50
    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    batch = 4 if dry else int(read_yaml(REPO / "config" / "cluster.yaml")["train"]["batch_size"])
    # enough images for one epoch of `steps` steps after the validation share is held out
    root = jpeg_tree(work / "jpeg", int(steps * batch / 0.97) + batch, 2 * batch,
                     (80, 96) if dry else (375, 500))
    config = study_config(root, dry, steps, skip)
    config_path = work / "study.yaml"
    config_path.write_text(yaml.safe_dump(config))
    data = work / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    subprocess.run([sys.executable, "-m", "dtstudy", "prepare-data", "--config", str(config_path), "--out", str(data)],
                   check=True, cwd=REPO, env=env)
    workers = config["loader"]["workers"]

    # interleaved: the reference before and after the study's run, so that a drift of the
    # machine's speed shows as a spread of the reference rather than as the study's ratio
    references = [reference_loop(config, root, device, steps, skip, workers)]
    metrics = study_run(config_path, data, work / "run")
    references.append(reference_loop(config, root, device, steps, skip, workers))
    epochs = epoch_sums(config, data, work / "inprocess", device)
    tested = evaluation(work / "run", data, work / "eval.json")
    delay = straggler_delay(device)

    step = metrics["step_time"]
    reference = sum(references) / len(references)
    data_share = step["data_s"] / (step["total_s"] + step["data_s"])
    sum_error = max(abs(e["sum_s"] - e["events_s"]) / e["events_s"] for e in epochs)
    checks = {
        "images_per_s_ratio_at_least_0.95": metrics["throughput"] / reference >= MIN_RATIO,
        "data_share_under_0.05": data_share < MAX_DATA_SHARE,
        "step_parts_sum_to_events_within_0.05": sum_error <= MAX_SUM_ERROR,
        "test_pass_on_the_runs_device": tested["device_type"] == device.type,
        "straggler_delay_on_the_device_timeline": delay["added_s"] >= 0.9 * delay["delay_s"],
    }
    record = {
        "what": ("ResNet-50, bf16 autocast, channels_last, cuDNN autotuning: the study's allreduce at N=1 "
                 "(python3 -m dtstudy train, config/cluster.yaml on a generated JPEG tree) against a "
                 "torchvision-reference-style loop with the same batch and loader workers"),
        "command": "bash tests/device/compute_check.sh" + (" --dry-run" if dry else ""),
        "dry_run": dry,
        "device": torch.cuda.get_device_name(0) if not dry else "cpu",
        "torch": torch.__version__,
        "batch_size": config["train"]["batch_size"],
        "image_size": config["dataset"]["image_size"],
        "loader_workers": workers,
        "steps": steps, "steady_state_skip": skip,
        "compute": metrics.get("compute"),
        "kernels": metrics["environment"].get("kernels"),
        "reference_images_per_s": references,
        "study_images_per_s": metrics["throughput"],
        "study_images_per_s_median_window": metrics["throughput_median"],
        "images_per_s_ratio": metrics["throughput"] / reference,
        "study_step_time_s": step,
        "data_share_of_step": data_share,
        "epochs_timed_outside": epochs,
        "step_parts_sum_error": sum_error,
        "evaluation": tested,
        "straggler_delay": delay,
        "checks": checks,
        "passed": all(checks.values()),
        "seconds": time.perf_counter() - started,
    }
    (args.out / "compute_check.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({key: record[key] for key in ("device", "reference_images_per_s", "study_images_per_s",
                                                   "images_per_s_ratio", "data_share_of_step",
                                                   "step_parts_sum_error", "evaluation", "straggler_delay",
                                                   "checks")}, indent=2))
    return 0 if dry or record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
