"""A test pass in channels-last against contiguous weights (not a test: prints times and
their ratio, measured side by side in one run).

Every validation point of a run and every `evaluate` job scores LeNet-5 on thousands of
images (`models.inference_layout`: eval mode, the 4-d weights swapped for channels-last
copies). Rounds alternate the model as trained (contiguous, eval mode) and that pass (the
copies included) on the same 10000 images in batches of `data.loading.EVAL_BATCH`, one thread as in a
worker. Prints the median [min - max] seconds per pass and the median of the per-round
ratios.

    python3 benchmarks/inference_layout.py [--rounds 7] [--images 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from dtstudy.data.loading import EVAL_BATCH
from dtstudy.training.models import build_model, inference_layout


@torch.no_grad()
def seconds_per_pass(model: torch.nn.Module, channels_last: bool, inputs: torch.Tensor) -> float:
    start = time.perf_counter()
    with inference_layout(model) if channels_last else contextlib.nullcontext(model.eval()):
        for first in range(0, len(inputs), EVAL_BATCH):
            model(inputs[first : first + EVAL_BATCH]).argmax(dim=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--images", type=int, default=10000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 10, 28)
    inputs = torch.randn(args.images, 1, 28, 28)
    passes = {"contiguous": False, "channels last": True}
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(args.rounds):
        for name, channels_last in passes.items():
            times[name].append(seconds_per_pass(model, channels_last, inputs))
    print(
        f"LeNet-5 forward pass on {args.images} images, batches of {EVAL_BATCH}, one thread, {args.rounds} rounds: "
        "seconds, median [min - max]"
    )
    for name, values in times.items():
        print(f"{name:>14}: {statistics.median(values):.3f} [{min(values):.3f} - {max(values):.3f}]")
    ratio = [last / plain for last, plain in zip(times["channels last"], times["contiguous"])]
    print(f"channels last / contiguous: median {statistics.median(ratio):.2f} [{min(ratio):.2f} - {max(ratio):.2f}]")


if __name__ == "__main__":
    main()
