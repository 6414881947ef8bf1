"""Test top-1/top-5 of a run's final checkpoint, on the run's kind of device with its input pipeline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dtstudy.common.atomic_files import write_json
from dtstudy.common.run_folder import RunFolder
from dtstudy.data.loading import EVAL_BATCH, iterate_batches, load_split
from dtstudy.tracking.live_run import server_away
from dtstudy.tracking.mlflow_store import log_test_metrics
from dtstudy.tracking.provenance import environment
from dtstudy.training.models import build_model, inference_layout


@torch.no_grad()
def topk_accuracy(
    model: torch.nn.Module, dataset, ks=(1, 5), batch_size: int = EVAL_BATCH, device: torch.device | str = "cpu"
) -> dict[int, float]:
    """Top-k accuracy on the whole `dataset`: in-memory sets indexed in batches, image sets
    decoded by their loader workers and moved to `device` (the split's own)."""
    correct = {k: 0 for k in ks}
    seen = 0
    indices = list(range(len(dataset)))
    if getattr(dataset, "is_in_memory", True):
        batches = iterate_batches(dataset, indices, batch_size, drop_last=False)
    else:
        batches = dataset.batches(indices[start : start + batch_size] for start in range(0, len(indices), batch_size))
    model = model.to(device)
    with inference_layout(model) as model:
        for inputs, labels in batches:
            inputs, labels = inputs.to(device), labels.to(device)
            logits = model(inputs)
            # top-5 of fewer than 5 classes: every class is in it (topk refuses k > classes)
            top = logits.topk(min(max(ks), logits.shape[1]), dim=1).indices
            hits = top == labels.unsqueeze(1)
            for k in ks:
                correct[k] += hits[:, :k].any(dim=1).sum().item()
            seen += len(labels)
    return {k: correct[k] / seen for k in ks}


def evaluation_device(preference: str) -> torch.device:
    """The run's kind of device (launcher.device): a GPU where the run trained on one and this
    job sees one, else the CPU; a run trained on a GPU (`cuda`) and tested on the CPU says so,
    since the test pass then takes far longer (same numbers up to rounding)."""
    if preference != "cpu" and torch.cuda.is_available():
        return torch.device("cuda")
    if preference == "cuda":
        print(
            "launcher.device is 'cuda' but this evaluate job sees no GPU: the test pass runs on the CPU "
            "(on SLURM an evaluate job asks for a GPU when launcher.gpus_per_node > 0; docs/cluster.md)",
            flush=True,
        )
    return torch.device("cpu")


def load_checkpoint(path: Path) -> torch.nn.Module:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(
        checkpoint["model"],
        checkpoint["in_channels"],
        checkpoint["num_classes"],
        checkpoint["image_size"],
        checkpoint["model_options"],
    )
    model.load_state_dict(checkpoint["state_dict"])
    return model


def log_test_metrics_or_keep(uri: str, result: dict) -> bool:
    """The test metrics added to the run in MLflow; False when its server is away (eval.json
    keeps them, and the aggregate step delivers them: tracking.live_run.deliver_pending)."""
    try:
        log_test_metrics(uri, result["mlflow_run_id"], result)
        return True
    except Exception as error:
        if not server_away(uri, error):
            raise
        print(
            f"[mlflow] {uri} unreachable ({type(error).__name__}): the test metrics are kept in eval.json "
            "and delivered by the aggregate step"
        )
        return False


def evaluate_run(run_dir: str | Path, data_dir: str | Path, out: str | Path) -> dict:
    folder, out = RunFolder(run_dir), Path(out)
    metrics = json.loads(folder.metrics.read_text())
    model = load_checkpoint(folder.model)
    config = metrics.get("config") or {}
    device = evaluation_device((config.get("launcher") or {}).get("device", "cpu"))
    test_set = load_split(data_dir, "test", config.get("loader"), device)
    start = time.perf_counter()
    accuracy = topk_accuracy(model, test_set, device=device)
    result = {
        "run_name": metrics.get("run_name"),
        "top1": accuracy[1],
        "top5": accuracy[5],
        "test_images": len(test_set),
        "checkpoint": str(folder.model),
        "seconds": time.perf_counter() - start,
        # where the test pass ran (a GPU, or a CPU job), its software and commit, as metrics.json's
        "environment": environment(device, backend=None, processes=1),
        "mlflow_run_id": (metrics.get("mlflow") or {}).get("run_id"),
    }
    if result["mlflow_run_id"]:
        result["mlflow_logged"] = log_test_metrics_or_keep(metrics["mlflow"]["tracking_uri"], result)
    print(f"{result['run_name']}: test top-1 {result['top1']:.4f} top-5 {result['top5']:.4f} on {len(test_set)} images")
    write_json(out, result)
    return result
