"""What every strategy of a study must share for its comparison to be fair, on an imagefolder
data set with training augmentation: BatchNorm statistics gathered under the training
transform whether they are running statistics or recomputed for an averaged model (the
averaging strategies, the same batches on every worker and on a re-run); an augmentation
stream of its own for every rank, reproducible whatever the loader's worker count and exact
on resume; and a loader that does not start a process per core of the node on every rank."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dataset_config, in_workers, tiny_study, validated
from PIL import Image

from dtstudy.data import feed
from dtstudy.data.loading import load_split
from dtstudy.data.prepare import prepare

SIZE, SEED, BATCH = 16, 3, 4


def loader_config(**changes) -> dict:
    from dtstudy.config.study_config import validate_schema

    return validate_schema({"loader": changes})["loader"]


@pytest.fixture(scope="module")
def same_image_tree(tmp_path_factory) -> Path:
    """A prepared imagefolder data set whose every file is the same JPEG: two images' pixels
    differ only where their augmentation draws differ."""
    root = tmp_path_factory.mktemp("same") / "tree"
    first = root / "ant" / "00.JPEG"
    first.parent.mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(first, quality=90)
    for name in ("ant", "bee"):
        (root / name).mkdir(exist_ok=True)
        for i in range(16):
            if (root / name / f"{i:02d}.JPEG") != first:
                shutil.copyfile(first, root / name / f"{i:02d}.JPEG")
    out = tmp_path_factory.mktemp("prepared")
    prepare(
        dataset_config(name="imagefolder", root=str(root), val_fraction=0.15, test_fraction=0.15, image_size=SIZE), out
    )
    return out


# ----- one real run at N = 2: what each rank trained on, and what the averaged model's BatchNorm saw


def _record_a_worker(ctx, spec, out: str) -> None:
    """Train `spec` on this rank through the real loop, saving the training split's batches (as
    the pipeline hands them to the steps) and the batches each BatchNorm recomputation ran on."""
    from dtstudy.data.feed import ImageFolderSplit
    from dtstudy.training.loop import train_worker

    trained, recomputed = [], []
    real_batches, real_update_bn = ImageFolderSplit.batches, torch.optim.swa_utils.update_bn

    def recording_batches(self, *args, **kwargs):
        for inputs, labels in real_batches(self, *args, **kwargs):
            if self.transform.name == "random_resized_crop_flip":  # the training split
                trained.append(inputs.clone())
            yield inputs, labels

    def recording_update_bn(loader, model, device=None):
        batches = [inputs.clone() for inputs in loader]
        recomputed.append(torch.cat(batches))
        real_update_bn(batches, model, device=device)

    ImageFolderSplit.batches = recording_batches
    torch.optim.swa_utils.update_bn = recording_update_bn
    train_worker(spec, ctx)
    torch.save({"trained": trained, "recomputed": recomputed}, Path(out) / f"rank{ctx.rank}.pt")


def run_and_record(tmp_path: Path, data: Path, loader_workers: int, name: str) -> list[dict]:
    """local_sgd (its averaged model's BatchNorm statistics recomputed) on ResNet-18 at N = 2,
    2 epochs, the run's seed SEED; per rank what `_record_a_worker` saved."""
    from dtstudy.config.study_config import run_config
    from dtstudy.runspec import RunSpec

    study = validated(
        tiny_study(
            dataset={
                "name": "imagefolder",
                "root": json.loads((data / "meta.json").read_text())["root"],
                "subset": None,
                "val_fraction": 0.15,
                "test_fraction": 0.15,
                "image_size": SIZE,
            },
            loader={"workers": loader_workers, "train_augment": "random_resized_crop_flip"},
            model="resnet18",
            strategies=["local_sgd"],
            workers=[2],
            strategy_params={"local_sgd": {"period": 2}},
            train={"epochs": 2, "batch_size": BATCH},
        )
    )
    out = tmp_path / name
    out.mkdir()
    spec = RunSpec(
        strategy="local_sgd",
        workers=2,
        seed=SEED,
        config=run_config(study, "local_sgd"),
        data_dir=str(data),
        out_dir=str(out / "run"),
    )
    in_workers(out, 2, _record_a_worker, spec, str(out))
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def recorded_runs(same_image_tree, tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """The same run twice: loader workers in the training process, then two worker processes."""
    tmp = tmp_path_factory.mktemp("runs")
    return run_and_record(tmp, same_image_tree, 0, "inline"), run_and_record(tmp, same_image_tree, 2, "workers")


@pytest.mark.slow
def test_each_rank_draws_its_own_augmentation_reproducibly(recorded_runs, same_image_tree):
    """Every file is the same image, so two ranks' batches are equal exactly when their crops
    and flips are: each rank must draw its own, and each epoch anew. The same seed gives the
    same pixels again, with another number of loader workers."""
    inline, workers = recorded_runs
    rank0, rank1 = inline[0]["trained"], inline[1]["trained"]
    assert len(rank0) == len(rank1) >= 4  # 2 epochs of 2 steps or more
    for step, (mine, theirs) in enumerate(zip(rank0, rank1)):
        assert not torch.equal(mine, theirs), f"step {step}: rank 1 trained on rank 0's crops"
    images = torch.cat(rank0)
    assert len({tuple(image.flatten()[:64].tolist()) for image in images}) > len(images) // 2  # not one crop for all
    # each epoch the two ranks see every image once (24 images, 3 steps of 4 each): another epoch, other crops
    steps = len(rank0) // 2
    assert 2 * steps * BATCH == len(load_split(same_image_tree, "train"))
    crops = [
        {
            tuple(image.flatten().tolist())
            for image in torch.cat(rank0[e * steps : (e + 1) * steps] + rank1[e * steps : (e + 1) * steps])
        }
        for e in range(2)
    ]
    assert crops[0] != crops[1]
    for rank in range(2):
        assert len(workers[rank]["trained"]) == len(inline[rank]["trained"])
        for step, (a, b) in enumerate(zip(inline[rank]["trained"], workers[rank]["trained"])):
            assert torch.equal(a, b), f"rank {rank} step {step}: another worker count drew other crops"


def test_an_averaged_models_batch_norm_statistics_come_from_training_batches_alike_on_every_rank(
    recorded_runs, same_image_tree
):
    """The averaged model's BatchNorm statistics are recomputed on the first images of the
    training split as the training pipeline augments them (not under evaluation's Resize +
    CenterCrop): the same batches on both ranks, at every recomputation, and on a re-run."""
    from dtstudy.data.augment import ResizeCenterCrop
    from dtstudy.data.decoding import decode_torchvision

    inline, workers = recorded_runs
    recomputed = inline[0]["recomputed"]
    assert len(recomputed) >= 2  # every evaluation of the averaged model
    train = load_split(same_image_tree, "train", loader_config(workers=0))
    # not evaluation's transform, which gives every copy of the image the same pixels
    centre = ResizeCenterCrop(SIZE)
    evaluation = centre.apply(decode_torchvision(Path(train.root) / train.samples[0][0]), centre.plan(0, 0))
    evaluation = (evaluation.float() / 255 - torch.tensor(train.mean).view(3, 1, 1)) / torch.tensor(train.std).view(
        3, 1, 1
    )
    assert not any(torch.allclose(image, evaluation, atol=1e-4) for image in recomputed[0])
    for run in (inline, workers):
        for rank in range(2):
            assert len(run[rank]["recomputed"]) == len(recomputed)
            for batches in run[rank]["recomputed"]:
                assert torch.equal(batches, recomputed[0]), f"rank {rank} recomputed on other images"
    # the training pipeline's pixels, as `batches` hands them to a step, for the run's seed
    from dtstudy.data.augment import BATCH_NORM, Draws

    first = list(range(len(recomputed[0])))
    as_trained = torch.cat(
        [
            inputs
            for inputs, _ in train.batches(
                [first[i : i + BATCH] for i in range(0, len(first), BATCH)], Draws(SEED, purpose=BATCH_NORM)
            )
        ]
    )
    assert torch.equal(recomputed[0], as_trained)


# ----- the feed: a resumed epoch draws what the interrupted one would have


def test_a_resumed_epoch_gets_the_augmentation_the_interrupted_one_would_have(same_image_tree):
    """A resumed run starts a fresh process (seeded as every run is) and skips the epoch's
    first batches: the batches after them carry the same crops as in the uninterrupted epoch."""
    from torch.utils.data import BatchSampler, DistributedSampler

    from dtstudy.data.augment import Draws
    from dtstudy.training.loop import epoch_batches, seed_everything

    def epoch(skip: int, workers: int) -> list[torch.Tensor]:
        seed_everything(SEED)
        train = load_split(same_image_tree, "train", loader_config(workers=workers))
        sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        sampler.set_epoch(1)
        batches = BatchSampler(sampler, BATCH, drop_last=True)
        return [inputs for inputs, _ in epoch_batches(train, batches, skip=skip, draws=Draws(SEED, 1))]

    whole = epoch(0, 1)
    resumed = epoch(2, 1)
    assert len(resumed) == len(whole) - 2 >= 1
    for a, b in zip(resumed, whole[2:]):
        assert torch.equal(a, b)
    assert not torch.equal(resumed[0], whole[0])  # control: the crops of the batch skipped differ


# ----- how many loader processes `loader.workers: null` starts


def test_null_loader_workers_are_bounded_on_a_node_that_does_not_bind_tasks(monkeypatch):
    """A SLURM task not bound to cores may use all of a 128-core node: its rank's loader gets
    its task's CPUs (SLURM_CPUS_PER_TASK) minus one, and never more than MAX_LOADER_WORKERS."""
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    assert feed.loader_workers(None) == 16
    assert feed.MAX_LOADER_WORKERS == 16  # torchvision's references' default (`--workers 16`)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert feed.loader_workers(None) == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # bound to fewer than the task asked
    assert feed.loader_workers(None) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert feed.loader_workers(None) == 0
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    assert feed.loader_workers(None) == 16
    assert feed.loader_workers(40) == 40  # a number in the config is taken as it is
