"""The imagefolder input pipeline (dtstudy.data.feed, .decoding, .augment): messy trees
(grayscale, CMYK, a PNG named .JPEG) decode to RGB with every decoder; augmentation on the
training split only; loader workers from the config, persistent across epochs; and a tiny
study on a messy tree trains and is evaluated end to end with no image skipped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dataset_config, read_json, tiny_study, validated
from PIL import Image

from dtstudy.data import feed as feed_module
from dtstudy.data.augment import Draws, ResizeCenterCrop
from dtstudy.data.checks import check_loader
from dtstudy.data.decoding import DALI_CHUNK, DECODERS, decode_pil, decode_torchvision, jpeg_frame, read_bytes
from dtstudy.data.errors import DataConfigError
from dtstudy.data.loading import load_split
from dtstudy.data.prepare import prepare

KINDS = ("rgb", "gray", "cmyk", "png_named_jpeg")
SIZE = 24


def loader_config(**changes) -> dict:
    """The `loader` section with `changes` and the schema's defaults for the rest."""
    from dtstudy.config.study_config import validate_schema

    return validate_schema({"loader": changes})["loader"]


def write_messy(path: Path, kind: str, rng, shape=(45, 60)) -> None:
    """One image file of `kind`, as ImageNet's training set has them."""
    image = Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
    if kind == "rgb":
        image.save(path, quality=90)
    elif kind == "gray":
        image.convert("L").save(path, quality=90)
    elif kind == "cmyk":
        image.convert("CMYK").save(path, quality=90)
    else:  # the extension says JPEG, the bytes say PNG
        image.save(path, format="PNG")


def write_messy_tree(root: Path, per_class: int, seed: int) -> Path:
    """root/<class>/*.JPEG, 3 classes of `per_class` files, each class with every kind of messy file."""
    rng = np.random.default_rng(seed)
    for name in ("ant", "bee", "cow"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            write_messy(root / name / f"{i:02d}.JPEG", KINDS[i % len(KINDS)], rng)
    return root


@pytest.fixture(scope="module")
def messy_tree(tmp_path_factory) -> Path:
    return write_messy_tree(tmp_path_factory.mktemp("messy") / "tree", per_class=12, seed=0)


@pytest.fixture(scope="module")
def prepared(messy_tree, tmp_path_factory) -> Path:
    cfg = dataset_config(
        name="imagefolder", root=str(messy_tree), val_fraction=0.2, test_fraction=0.25, image_size=SIZE
    )
    out = tmp_path_factory.mktemp("prepared")
    prepare(cfg, out)
    return out


# ----- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("decoder", ["torchvision", "pil"])
def test_every_messy_file_decodes_to_rgb_like_pil(tmp_path, kind, decoder):
    path = tmp_path / "x.JPEG"
    write_messy(path, kind, np.random.default_rng(1))
    with Image.open(path) as image:
        expected = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
    decoded = {"torchvision": decode_torchvision, "pil": decode_pil}[decoder](path)
    assert decoded.dtype == torch.uint8 and decoded.shape == (3, 45, 60)
    # libjpeg-turbo in both; the colour conversion of a grayscale or CMYK JPEG may round apart by 1
    assert (decoded.int() - expected.int()).abs().max() <= 1


def test_the_rgb_check_catches_a_decoder_that_keeps_the_files_mode(tmp_path):
    """Control: decoding as stored (no conversion) gives 1 channel for grayscale and 4 for
    CMYK, and trusting the extension fails on the PNG named .JPEG."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file

    rng = np.random.default_rng(1)
    channels = {}
    for kind in ("gray", "cmyk"):
        write_messy(tmp_path / f"{kind}.JPEG", kind, rng)
        channels[kind] = decode_image(read_file(str(tmp_path / f"{kind}.JPEG")), mode=ImageReadMode.UNCHANGED).shape[0]
    assert channels == {"gray": 1, "cmyk": 4}
    write_messy(tmp_path / "png.JPEG", "png_named_jpeg", rng)
    with pytest.raises(RuntimeError):
        decode_jpeg(read_file(str(tmp_path / "png.JPEG")))


def test_jpeg_frame_reads_size_and_components_from_the_header(tmp_path):
    rng = np.random.default_rng(2)
    for kind, components in (("rgb", 3), ("gray", 1), ("cmyk", 4)):
        write_messy(tmp_path / f"{kind}.jpg", kind, rng, shape=(37, 53))
        assert jpeg_frame((tmp_path / f"{kind}.jpg").read_bytes()) == (37, 53, components)
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(tmp_path / "p.jpg", progressive=True)
    assert jpeg_frame((tmp_path / "p.jpg").read_bytes()) == (40, 30, 3)
    write_messy(tmp_path / "png.jpg", "png_named_jpeg", rng)
    assert jpeg_frame((tmp_path / "png.jpg").read_bytes()) is None
    assert jpeg_frame((tmp_path / "rgb.jpg").read_bytes()[:20]) is None  # cut before its frame header


@pytest.mark.parametrize("split", ["train", "test"])
def test_nvjpeg_path_on_the_cpu_gives_the_torchvision_decoders_pixels(prepared, split):
    """nvJPEG's batch path (crop drawn from the JPEG header in the worker, decode_jpeg on the
    batch, crop after) run on the CPU: the same pixels as decoding first, for the same seed;
    the grayscale, CMYK and PNG files take the workers' CPU path inside the same batch."""

    def pixels(decoder: str, seed: int) -> torch.Tensor:
        data = load_split(prepared, split, loader_config(workers=0, decoder=decoder))
        return torch.cat([inputs for inputs, _ in data.batches([range(0, 6), range(6, len(data))], Draws(seed))])

    assert torch.equal(pixels("nvjpeg", 0), pixels("torchvision", 0))
    if split == "train":  # control: the comparison sees another draw of the crops
        assert not torch.equal(pixels("nvjpeg", 0), pixels("torchvision", 1))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_dali_cpu_decodes_only_the_crops_region_and_gives_the_torchvision_decoders_pixels(prepared, workers):
    """DALI's fused decode-and-crop (training split) in the training process and in worker
    processes: the same pixels as decoding the whole file first, for the same seed; the
    grayscale, CMYK and PNG files take the workers' CPU path inside the same batch."""

    def pixels(decoder: str, seed: int) -> torch.Tensor:
        data = load_split(prepared, "train", loader_config(workers=workers, decoder=decoder))
        return torch.cat([inputs for inputs, _ in data.batches([range(0, 6), range(6, len(data))], Draws(seed))])

    assert torch.equal(pixels("dali_cpu", 0), pixels("torchvision", 0))
    assert not torch.equal(pixels("dali_cpu", 0), pixels("torchvision", 1))  # control: another draw


def test_dali_cpu_decodes_the_region_alone(tmp_path):
    """The region DALI hands back is the crop's (not the whole image cropped afterwards by
    chance of equal sizes): each plan's region, for crops of every corner and size, over
    more JPEGs than one DALI run takes."""
    from dtstudy.data.augment import RandomResizedCropFlip

    rng = np.random.default_rng(3)
    write_messy(tmp_path / "x.JPEG", "rgb", rng, shape=(90, 120))
    whole = decode_torchvision(tmp_path / "x.JPEG")
    decoder, generator = DECODERS["dali_cpu"](), torch.Generator().manual_seed(0)
    crop = RandomResizedCropFlip(SIZE)
    data = read_bytes(tmp_path / "x.JPEG")
    items = [decoder.load(data, crop, generator) for _ in range(DALI_CHUNK + 4)]  # two of DALI's runs
    assert {item[0] for item in items} == {"jpeg"}  # every one took DALI's path
    plans = [plan for _, _, plan in items]
    regions = decoder._decode_regions([data for _, data, _ in items], plans)
    for region, (top, left, h, w, _) in zip(regions, (plan.tolist() for plan in plans)):
        assert torch.equal(region, whole[:, top : top + h, left : left + w])
    assert len({tuple(region.shape) for region in regions}) > 1  # control: the plans differ
    # evaluation's transform reads the whole image: the file is decoded whole, as torchvision does
    assert decoder.load(data, ResizeCenterCrop(SIZE))[0] == "pixels"


def test_dali_cpu_without_dali_installed_is_refused_naming_the_key(monkeypatch):
    from dtstudy.data import checks

    check_loader(loader_config(decoder="dali_cpu"), "cpu")  # installed here (envs/requirements.txt)
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataConfigError, match=r"loader\.decoder: 'dali_cpu' needs NVIDIA DALI.*torchvision"):
        check_loader(loader_config(decoder="dali_cpu"), "cpu")
    check_loader(loader_config(decoder="torchvision"), "cpu")  # control: other decoders need no DALI


def test_nvjpeg_on_a_cpu_run_is_refused_naming_the_key():
    with pytest.raises(DataConfigError, match=r"loader\.decoder: 'nvjpeg'.*launcher\.device"):
        check_loader(loader_config(decoder="nvjpeg"), "cpu")
    check_loader(loader_config(decoder="nvjpeg"), "cuda")
    check_loader(loader_config(decoder="nvjpeg"), "auto")  # resolved when the worker has its device
    with pytest.raises(Exception, match="loader.decoder"):
        validated(tiny_study(loader={"decoder": "nvjpeg"}, launcher={"device": "cpu"}))


# ----- augmentation ---------------------------------------------------------------------------


def two_passes_differ(split) -> bool:
    """Whether two epochs over the same images give different pixels (random augmentation)."""
    first = torch.cat([x for x, _ in split.batches([range(len(split))], Draws(0, epoch=0))])
    second = torch.cat([x for x, _ in split.batches([range(len(split))], Draws(0, epoch=1))])
    return not torch.equal(first, second)


def test_augmentation_on_the_training_split_only(prepared):
    loader = loader_config(workers=0)
    assert loader["train_augment"] == "random_resized_crop_flip"  # the default a run's config records
    train, val, test = (load_split(prepared, split, loader) for split in ("train", "val", "test"))
    assert two_passes_differ(train)
    assert not two_passes_differ(val) and not two_passes_differ(test)
    # evaluation's pixels are Resize + CenterCrop of the decoded file, normalised
    assert torch.equal(next(val.batches([range(len(val))]))[0], val.batch(range(len(val)))[0])
    path = Path(json.loads((prepared / "meta.json").read_text())["root"]) / val.samples[0][0]
    crop = ResizeCenterCrop(SIZE)
    expected = crop.apply(decode_torchvision(path), crop.plan(0, 0))
    normalised = next(val.batches([[0]]))[0][0]
    assert torch.allclose(
        normalised,
        (expected.float() / 255 - torch.tensor(val.mean).view(3, 1, 1)) / torch.tensor(val.std).view(3, 1, 1),
        atol=1e-5,
    )
    # controls: the check sees a training split without augmentation, and one that augments val
    assert not two_passes_differ(load_split(prepared, "train", loader_config(workers=0, train_augment="center_crop")))
    planted = load_split(prepared, "val", loader)
    planted.transform = train.transform  # the bug: the training transform on an evaluation split
    assert two_passes_differ(planted)


def test_training_crops_cover_the_image_at_random_scales_and_flip(prepared):
    """RandomResizedCrop's draws: areas across 8%-100% of the image, aspect within 3/4-4/3,
    about half of them flipped (a transform that always takes the centre fails each)."""
    train = load_split(prepared, "train", loader_config(workers=0))
    generator = torch.Generator().manual_seed(0)
    plans = torch.stack([train.transform.plan(375, 500, generator) for _ in range(2000)])
    top, left, h, w, flip = plans.T
    area = (h * w).double() / (375 * 500)
    assert area.min() < 0.12 and area.max() > 0.9 and (area >= 0.079).all()
    assert ((w / h >= 3 / 4 * 0.97) & (w / h <= 4 / 3 * 1.03)).all()
    assert (top + h <= 375).all() and (left + w <= 500).all() and (top >= 0).all() and (left >= 0).all()
    assert 0.45 < flip.double().mean() < 0.55
    centre = ResizeCenterCrop(SIZE).plan(375, 500)
    assert centre.numel() == 0  # control: evaluation's transform draws nothing


# ----- loader workers -------------------------------------------------------------------------


def test_loader_workers_come_from_the_config_and_persist(prepared, monkeypatch):
    train = load_split(prepared, "train", loader_config(workers=2, prefetch=3))
    list(train.batches([range(4)]))
    loader = train._feed.loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    pids = sorted(w.pid for w in loader._iterator._workers)
    list(train.batches([range(4, 8)]))  # the next epoch: the same worker processes
    assert sorted(w.pid for w in loader._iterator._workers) == pids and len(pids) == 2
    # null: the CPUs this process may use, minus the training process's own
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert load_split(prepared, "train", loader_config(workers=None)).workers == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert load_split(prepared, "train", loader_config(workers=None)).workers == 0
    # control: another setting gives another count (the value is read, not a constant)
    assert load_split(prepared, "train", loader_config(workers=1)).workers == 1
    assert feed_module.loader_workers(3) == 3


def test_a_resumed_epoch_skips_its_first_batches_through_the_persistent_loader(prepared):
    """epoch_batches(skip=k) on an image split: the epoch's batches from the k-th on (what a
    resumed run gets), through the same worker processes; an epoch without skip gets them all."""
    from torch.utils.data import BatchSampler, SequentialSampler

    from dtstudy.training.loop import epoch_batches

    train = load_split(prepared, "train", loader_config(workers=1, train_augment="center_crop"))
    sampler = BatchSampler(SequentialSampler(range(len(train))), 4, drop_last=True)
    whole = [labels.tolist() for _, labels in epoch_batches(train, sampler)]
    pids = [w.pid for w in train._feed.loader._iterator._workers]
    resumed = [(inputs, labels.tolist()) for inputs, labels in epoch_batches(train, sampler, skip=2)]
    assert [labels for _, labels in resumed] == whole[2:] and len(whole) == len(train) // 4
    assert [w.pid for w in train._feed.loader._iterator._workers] == pids
    assert torch.equal(resumed[0][0], train.batch(range(8, 12))[0])  # the third batch's pixels
    assert not torch.equal(resumed[0][0], train.batch(range(0, 4))[0])  # control: not the first's


def test_in_memory_data_ignore_the_loader_section(tiny_data):
    plain = load_split(tiny_data, "train")
    configured = load_split(tiny_data, "train", loader_config(workers=3, decoder="pil"), "cpu")
    assert configured.is_in_memory
    assert torch.equal(plain.batch([0, 5, 9])[0], configured.batch([0, 5, 9])[0])


# ----- end to end -----------------------------------------------------------------------------


def test_a_gpu_run_tested_without_a_gpu_says_so(capsys):
    """A run trained with launcher.device 'cuda' whose evaluate job sees no GPU is tested on the
    CPU, and its log says why it is slow; `auto` and `cpu` runs are tested on the CPU silently."""
    from dtstudy.training.evaluate import evaluation_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert evaluation_device("cuda") == torch.device("cpu")
    assert "launcher.device is 'cuda' but this evaluate job sees no GPU" in capsys.readouterr().out
    assert evaluation_device("auto") == evaluation_device("cpu") == torch.device("cpu")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "decoder, shard_mb", [("torchvision", None), ("dali_cpu", 0.008)], ids=["files", "dali_from_shards"]
)
@pytest.mark.slow
def test_a_tiny_study_on_a_messy_tree_trains_in_bf16_and_evaluates_every_image(messy_tree, tmp_path, decoder, shard_mb):
    from dtstudy.config.study_config import run_config
    from dtstudy.launch.launcher import run_training_job
    from dtstudy.runspec import RunSpec
    from dtstudy.training.evaluate import evaluate_run

    study = validated(
        tiny_study(
            dataset={
                "name": "imagefolder",
                "root": str(messy_tree),
                "subset": None,
                "val_fraction": 0.2,
                "test_fraction": 0.25,
                "image_size": SIZE,
                "shard_mb": shard_mb,
            },
            loader={"workers": 1, "decoder": decoder},
            workers=[2],
            train={"batch_size": 4, "epochs": 2, "log_every": 2, "steady_state_skip": 1, "precision": "bf16"},
        )
    )
    data = tmp_path / "data"
    meta = prepare(study["dataset"], data)
    assert meta["skipped_images"] == 0 and sum(meta["sizes"].values()) == 36  # every file kept
    assert (meta["shards"] is None) == (shard_mb is None) and (data / "shards.json").exists() == (shard_mb is not None)
    spec = RunSpec("allreduce", 2, 0, run_config(study, "allreduce"), str(data), str(tmp_path / "run"))
    metrics = run_training_job(spec, tmp_path / "run" / "submitit")
    assert metrics["config"]["loader"] == {
        "workers": 1,
        "decoder": decoder,
        "train_augment": "random_resized_crop_flip",
        "prefetch": 2,
    }
    assert metrics["steps"] == 2 * (meta["sizes"]["train"] // (2 * 4))
    assert metrics["compute"]["precision"] == "bf16" and metrics["compute"]["autocast_dtype"] == "bfloat16"
    assert [entry["images"] for entry in metrics["val"]] == [meta["sizes"]["val"]] * 2  # every val image
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "submitit").rglob("*_log.out"))
    assert "input pipeline: train {'transform': 'random_resized_crop_flip'" in logs and "'workers': 1" in logs
    assert f"'decoder': '{decoder}'" in logs  # the value of loader.decoder, as the user wrote it
    result = evaluate_run(tmp_path / "run", data, tmp_path / "eval.json")
    assert result["test_images"] == meta["sizes"]["test"] == 9
    assert result["top5"] == 1.0  # 3 classes: every class is in the top 5 (k beyond the classes is capped)
    assert read_json(tmp_path / "eval.json")["top1"] == result["top1"]
    # where the test pass ran, traceable as the training's: the device, and the commit
    tested_on, trained_on = read_json(tmp_path / "eval.json")["environment"], metrics["environment"]
    assert tested_on["device_type"] == "cpu" and tested_on["devices"] == trained_on["devices"]
    assert tested_on["git_commit"] == trained_on["git_commit"] and tested_on["backend"] is None
