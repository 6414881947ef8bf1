"""Tests of dtstudy.data: real Fashion-MNIST (first 600 images), synthetic data, a tiny image folder."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, dataset_config

from dtstudy.data.checks import check_dataset
from dtstudy.data.errors import DataConfigError
from dtstudy.data.formats import DEFAULT_FASHION_MNIST_ROOT, FASHION_MNIST_FILES
from dtstudy.data.loading import iterate_batches, load_split
from dtstudy.data.prepare import IMAGENET_MEAN, IMAGENET_STD, prepare

FMNIST = Path(DEFAULT_FASHION_MNIST_ROOT)
BASE_KEYS = {"name": "fashion_mnist", "subset": 600}  # the rest: the schema's defaults


def make_cfg(**changes):
    """The dataset section of a config: BASE_KEYS, `changes`, the schema's defaults for the rest."""
    return dataset_config(**{**BASE_KEYS, **changes})


def read_idx_gz(name: str) -> np.ndarray:
    """Independent decoder: the idx header is 16 bytes for images, 8 for labels."""
    raw = gzip.open(FMNIST / name).read()
    if "images" in name:
        return np.frombuffer(raw, np.uint8, offset=16).reshape(-1, 28, 28)
    return np.frombuffer(raw, np.uint8, offset=8)


@pytest.fixture(scope="module")
def fmnist_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fmnist")
    prepare(make_cfg(), out)
    return out


def load_pt(path):
    return torch.load(path, weights_only=True)


# ------------------------------------------------------------------- fashion_mnist


def test_prepare_fashion_mnist_files_shapes_and_meta(fmnist_dir):
    assert sorted(p.name for p in fmnist_dir.iterdir()) == ["meta.json", "test.pt", "train.pt", "val.pt"]
    sizes = {"train": 540, "val": 60, "test": 10000}
    for split, n in sizes.items():
        blob = load_pt(fmnist_dir / f"{split}.pt")
        assert blob["images"].shape == (n, 1, 28, 28) and blob["images"].dtype == torch.uint8
        assert blob["labels"].shape == (n,) and blob["labels"].dtype == torch.int64
        assert 0 <= blob["labels"].min() and blob["labels"].max() <= 9
    meta = json.loads((fmnist_dir / "meta.json").read_text())
    assert meta["format"] == "tensors" and meta["name"] == "fashion_mnist"
    assert (meta["channels"], meta["height"], meta["width"], meta["classes"]) == (1, 28, 28, 10)
    assert meta["sizes"] == sizes
    assert 0.27 < meta["mean"][0] < 0.30 and 0.33 < meta["std"][0] < 0.37
    train = load_pt(fmnist_dir / "train.pt")["images"].double() / 255
    assert meta["mean"][0] == pytest.approx(train.mean().item(), abs=1e-9)
    assert meta["std"][0] == pytest.approx(train.std(unbiased=False).item(), abs=1e-9)
    assert (meta["subset"], meta["val_fraction"], meta["split_seed"]) == (600, 0.1, 0)
    assert set(meta["source_files"]) == {f"{name}.gz" for name in FASHION_MNIST_FILES.values()}
    assert all(len(digest) == 64 for digest in meta["source_files"].values())


def test_split_is_seeded_permutation_of_first_images(fmnist_dir):
    images = torch.from_numpy(read_idx_gz("train-images-idx3-ubyte.gz")[:600].copy()).unsqueeze(1)
    labels = torch.from_numpy(read_idx_gz("train-labels-idx1-ubyte.gz")[:600].astype(np.int64))
    train, val = (load_pt(fmnist_dir / f"{s}.pt") for s in ("train", "val"))
    perm = torch.randperm(600, generator=torch.Generator().manual_seed(0))
    assert torch.equal(val["images"], images[perm[:60]]) and torch.equal(val["labels"], labels[perm[:60]])
    assert torch.equal(train["images"], images[perm[60:]]) and torch.equal(train["labels"], labels[perm[60:]])
    # disjoint and complete, checked on the pixels themselves
    rows = {bytes(img.numpy()) for img in torch.cat([train["images"], val["images"]])}
    assert rows == {bytes(img.numpy()) for img in images} and len(rows) == len(set(rows))


def test_test_split_is_official_test_set(fmnist_dir):
    test = load_pt(fmnist_dir / "test.pt")
    official = torch.from_numpy(read_idx_gz("t10k-images-idx3-ubyte.gz").copy())
    assert torch.equal(test["images"][:, 0], official)
    assert test["labels"].tolist() == read_idx_gz("t10k-labels-idx1-ubyte.gz").tolist()


def test_prepare_is_deterministic(fmnist_dir, tmp_path):
    meta = prepare(make_cfg(), tmp_path)
    assert meta == json.loads((fmnist_dir / "meta.json").read_text())
    for name in ("train.pt", "val.pt", "test.pt", "meta.json"):
        assert (tmp_path / name).read_bytes() == (fmnist_dir / name).read_bytes(), name
    assert not list(tmp_path.glob(".*.tmp"))


def test_other_seed_changes_split(fmnist_dir, tmp_path):
    prepare(make_cfg(split_seed=1), tmp_path)
    assert not torch.equal(load_pt(tmp_path / "val.pt")["labels"], load_pt(fmnist_dir / "val.pt")["labels"])


# ---------------------------------------------------------------------- load_split


def test_load_split_batch_normalised_with_right_labels(fmnist_dir):
    train = load_split(fmnist_dir, "train")
    assert (len(train), train.num_classes, train.channels, train.is_in_memory) == (540, 10, 1, True)
    inputs, labels = train.batch(torch.arange(len(train)))
    assert inputs.dtype == torch.float32 and labels.dtype == torch.int64
    assert inputs.shape == (540, 1, 28, 28)
    assert abs(inputs.mean().item()) < 1e-4 and inputs.std().item() == pytest.approx(1, abs=1e-3)
    raw = load_pt(fmnist_dir / "train.pt")
    meta = json.loads((fmnist_dir / "meta.json").read_text())
    idx = torch.tensor([5, 0, 539, 5])
    inputs, labels = train.batch(idx)
    assert torch.equal(labels, raw["labels"][idx])
    expected = (raw["images"][idx].double() / 255 - meta["mean"][0]) / meta["std"][0]
    assert torch.allclose(inputs.double(), expected, atol=1e-5)


def test_load_split_sizes_and_bad_split(fmnist_dir):
    assert len(load_split(fmnist_dir, "val")) == 60
    assert len(load_split(fmnist_dir, "test")) == 10000
    with pytest.raises(ValueError, match="split"):
        load_split(fmnist_dir, "validation")


def test_iterate_batches(fmnist_dir):
    val = load_split(fmnist_dir, "val")
    indices = list(range(59, -1, -1))
    chunks = list(iterate_batches(val, indices, 25, drop_last=False))
    assert [len(labels) for _, labels in chunks] == [25, 25, 10]
    assert torch.equal(torch.cat([labels for _, labels in chunks]), val.batch(torch.tensor(indices))[1])
    chunks = list(iterate_batches(val, torch.tensor(indices), 25, drop_last=True))
    assert [len(labels) for _, labels in chunks] == [25, 25]


# -------------------------------------------------------------------- check_dataset


def test_check_dataset_default_root_counts_60000():
    assert check_dataset(make_cfg(subset=None)) == 60000


def test_check_dataset_subset_too_large():
    with pytest.raises(DataConfigError) as err:
        check_dataset(make_cfg(subset=70000))
    assert "dataset.subset" in str(err.value) and "60000" in str(err.value) and "70000" in str(err.value)


def test_check_dataset_missing_root(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataConfigError) as err:
        check_dataset(make_cfg(root=str(missing)))
    assert "dataset.root" in str(err.value) and str(missing) in str(err.value)


def test_check_dataset_root_without_files(tmp_path):
    with pytest.raises(DataConfigError, match="dataset.root.*train-images-idx3-ubyte"):
        check_dataset(make_cfg(root=str(tmp_path)))
    assert check_dataset(make_cfg(root=str(tmp_path), download=True)) == 60000


def test_check_dataset_torchvision_layout_unpacked(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FASHION_MNIST_FILES.values():
        (raw / name).write_bytes(gzip.open(FMNIST / f"{name}.gz").read())
    assert check_dataset(make_cfg(root=str(tmp_path))) == 60000
    meta = prepare(make_cfg(root=str(tmp_path), subset=100), tmp_path / "out")
    assert meta["sizes"] == {"train": 90, "val": 10, "test": 10000}
    assert "FashionMNIST/raw/train-images-idx3-ubyte" in meta["source_files"]


def test_check_dataset_cifar10_needs_root(tmp_path):
    with pytest.raises(DataConfigError, match="dataset.root.*cifar10"):
        check_dataset(make_cfg(name="cifar10", subset=None))
    with pytest.raises(DataConfigError, match="cifar-10-batches-py"):
        check_dataset(make_cfg(name="cifar10", root=str(tmp_path), subset=None))


def test_check_dataset_empty_validation_split():
    with pytest.raises(DataConfigError, match="dataset.val_fraction"):
        check_dataset(make_cfg(subset=4))


def test_check_dataset_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from dtstudy.data.checks import check_dataset; "
        f"check_dataset({make_cfg()!r}); assert 'torch' not in sys.modules"
    )
    env = {"PYTHONPATH": str(REPO / "workflow")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------------------ synthetic


def test_synthetic_prepare_and_load(tmp_path):
    syn = {"train_size": 50, "test_size": 8, "channels": 3, "classes": 4}
    cfg = make_cfg(name="synthetic", subset=None, image_size=16, synthetic=syn)
    assert check_dataset(cfg) == 50
    meta = prepare(cfg, tmp_path / "a")
    assert meta["sizes"] == {"train": 45, "val": 5, "test": 8}
    assert (meta["channels"], meta["height"], meta["classes"], meta["source_files"]) == (3, 16, 4, {})
    train = load_split(tmp_path / "a", "train")
    inputs, labels = train.batch(torch.arange(10))
    assert inputs.shape == (10, 3, 16, 16) and labels.max() < 4
    assert (train.num_classes, train.channels) == (4, 3)
    prepare(cfg, tmp_path / "b")
    assert (tmp_path / "a" / "train.pt").read_bytes() == (tmp_path / "b" / "train.pt").read_bytes()


# ---------------------------------------------------------------------- imagefolder


@pytest.fixture
def image_tree(tmp_path):
    from PIL import Image

    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    counts = {"train": 3, "test": 1}
    for split, n in counts.items():
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (40 + 5 * i, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
    return root


def test_imagefolder_prepare_and_load(image_tree, tmp_path):
    cfg = make_cfg(name="imagefolder", root=str(image_tree), subset=None, val_fraction=0.34, image_size=32)
    assert check_dataset(cfg) == 6
    out = tmp_path / "prepared"
    meta = prepare(cfg, out)
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "meta.json"]
    assert meta["format"] == "imagefolder" and meta["channels"] == 3 and meta["classes"] == 2
    assert meta["sizes"] == {"train": 4, "val": 2, "test": 2}
    assert meta["mean"] == IMAGENET_MEAN and meta["std"] == IMAGENET_STD
    index = json.loads((out / "index.json").read_text())
    assert index["classes"] == ["cat", "dog"]
    assert sorted(map(tuple, index["train"] + index["val"])) == [
        (f"train/{cls}/{i}.png", label) for label, cls in enumerate(["cat", "dog"]) for i in range(3)
    ]
    assert sorted(map(tuple, index["test"])) == [("test/cat/0.png", 0), ("test/dog/0.png", 1)]

    train = load_split(out, "train")
    assert isinstance(train, torch.utils.data.Dataset) and train.is_in_memory is False
    assert (len(train), train.num_classes, train.channels) == (4, 2, 3)
    inputs, labels = train.batch(torch.tensor([0, 3]))
    assert inputs.shape == (2, 3, 32, 32) and inputs.dtype == torch.float32
    assert labels.tolist() == [index["train"][0][1], index["train"][3][1]]
    loader = torch.utils.data.DataLoader(load_split(out, "test"), batch_size=2)
    inputs, labels = next(iter(loader))
    assert inputs.shape == (2, 3, 32, 32) and sorted(labels.tolist()) == [0, 1]


def test_imagefolder_needs_class_folders(tmp_path):
    with pytest.raises(DataConfigError, match="dataset.root.*no class folders"):
        check_dataset(make_cfg(name="imagefolder", root=str(tmp_path), subset=None))
    with pytest.raises(DataConfigError, match="dataset.root.*imagefolder"):
        check_dataset(make_cfg(name="imagefolder", root=None, subset=None))


def test_imagefolder_subset_keeps_first_files(image_tree, tmp_path):
    cfg = make_cfg(name="imagefolder", root=str(image_tree), subset=4, val_fraction=0.25, image_size=32)
    meta = prepare(cfg, tmp_path)
    assert meta["sizes"] == {"train": 3, "val": 1, "test": 2}
    index = json.loads((tmp_path / "index.json").read_text())
    kept = sorted(map(tuple, index["train"] + index["val"]))
    assert kept == [("train/cat/0.png", 0), ("train/cat/1.png", 0), ("train/cat/2.png", 0), ("train/dog/0.png", 1)]
