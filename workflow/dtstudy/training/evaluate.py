"""Test top-1/top-5 of a run's final checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dtstudy.data.loading import EVAL_BATCH, iterate_batches, load_split
from dtstudy.training.models import build_model, inference_layout
from dtstudy.atomic_files import write_json
from dtstudy.tracking.mlflow_store import log_test_metrics
from dtstudy.runspec import CHECKPOINT_FILE, METRICS_FILE


@torch.no_grad()
def topk_accuracy(model: torch.nn.Module, dataset, ks=(1, 5), batch_size: int = EVAL_BATCH) -> dict[int, float]:
    correct = {k: 0 for k in ks}
    seen = 0
    with inference_layout(model) as model:
        for inputs, labels in iterate_batches(dataset, list(range(len(dataset))), batch_size,
                                              drop_last=False):
            top = model(inputs).topk(max(ks), dim=1).indices
            hits = top == labels.unsqueeze(1)
            for k in ks:
                correct[k] += hits[:, :k].any(dim=1).sum().item()
            seen += len(labels)
    return {k: correct[k] / seen for k in ks}


def load_checkpoint(path: Path) -> torch.nn.Module:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(
        checkpoint["model"], checkpoint["in_channels"], checkpoint["num_classes"],
        checkpoint["image_size"], checkpoint["model_options"],
    )
    model.load_state_dict(checkpoint["state_dict"])
    return model


def evaluate_run(run_dir: str | Path, data_dir: str | Path, out: str | Path) -> dict:
    run_dir, out = Path(run_dir), Path(out)
    metrics = json.loads((run_dir / METRICS_FILE).read_text())
    model = load_checkpoint(run_dir / CHECKPOINT_FILE)
    test_set = load_split(data_dir, "test")
    start = time.perf_counter()
    accuracy = topk_accuracy(model, test_set)
    result = {
        "run_name": metrics.get("run_name"),
        "top1": accuracy[1],
        "top5": accuracy[5],
        "test_images": len(test_set),
        "checkpoint": str(run_dir / CHECKPOINT_FILE),
        "seconds": time.perf_counter() - start,
        "mlflow_run_id": (metrics.get("mlflow") or {}).get("run_id"),
    }
    if result["mlflow_run_id"]:
        log_test_metrics(metrics["mlflow"]["tracking_uri"], result["mlflow_run_id"], result)
    print(f"{result['run_name']}: test top-1 {result['top1']:.4f} top-5 {result['top5']:.4f} on {len(test_set)} images")
    write_json(out, result)
    return result
