"""Every data-set input a user can give gets a clear answer before training: plain ImageFolder
trees split with a fixed seed, and empty, single-class, corrupt or truncated inputs refused
(or, for corrupt images, skipped on request) with the key and the file or folder named."""

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, dataset_config
from PIL import Image

from dtstudy.data.checks import PICKLE_STOP, check_dataset
from dtstudy.data.errors import DataConfigError
from dtstudy.data.formats import CIFAR10_DIR, CIFAR10_FILES, FASHION_MNIST_FILES
from dtstudy.data.loading import load_split
from dtstudy.data.prepare import SPLITS, prepare

BASE_KEYS = {"name": "imagefolder", "val_fraction": 0.25, "test_fraction": 0.2, "image_size": 16}


def make_cfg(**changes):
    """The dataset section of a config: BASE_KEYS, `changes`, the schema's defaults for the rest."""
    return dataset_config(**{**BASE_KEYS, **changes})


def write_images(folder: Path, n: int, seed: int, suffix: str = ".png") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        path = folder / f"img{i:02d}{suffix}"
        Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def all_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def error_of(call, *args) -> str:
    with pytest.raises(DataConfigError) as err:
        call(*args)
    return str(err.value)


@pytest.fixture
def plain_tree(tmp_path):
    """root/<class>/<image>, ImageFolder's layout: 10, 10 and 7 images, one class with a sub-folder."""
    root = tmp_path / "plain"
    write_images(root / "cat", 10, seed=1)
    write_images(root / "dog", 6, seed=2)
    write_images(root / "dog" / "more", 4, seed=3, suffix=".JPG")
    write_images(root / "owl", 7, seed=4)
    (root / "owl" / "README.txt").write_text("not an image")
    return root


def read_index(out: Path) -> dict:
    return json.loads((out / "index.json").read_text())


# ------------------------------------------------------------------ plain ImageFolder


def test_plain_tree_split_is_stratified_disjoint_complete_and_seeded(plain_tree, tmp_path):
    from torchvision.datasets import ImageFolder

    cfg = make_cfg(root=str(plain_tree))
    # held out per class: round(0.2 * 10) = 2, 2, round(0.2 * 7) = 1 -> 27 - 5 = 22 for training
    assert check_dataset(cfg) == 22
    meta = prepare(cfg, tmp_path / "a")
    index = read_index(tmp_path / "a")
    assert meta["layout"] == "plain" and meta["test_source"] == "held out" and meta["test_fraction"] == 0.2
    assert meta["sizes"] == {"train": 16, "val": 6, "test": 5} and meta["classes"] == 3

    reference = ImageFolder(str(plain_tree))
    assert index["classes"] == reference.classes
    expected = {Path(path).relative_to(plain_tree).as_posix(): label for path, label in reference.samples}
    splits = {split: [tuple(sample) for sample in index[split]] for split in SPLITS}
    used = [sample for split in SPLITS for sample in splits[split]]
    assert len(used) == len(set(used)) == len(expected)  # disjoint, each image once
    assert dict(used) == expected  # every image, with ImageFolder's label
    assert sorted(label for _, label in splits["test"]) == [0, 0, 1, 1, 2]  # stratified

    prepare(cfg, tmp_path / "b")
    assert (tmp_path / "b" / "index.json").read_bytes() == (tmp_path / "a" / "index.json").read_bytes()
    prepare(make_cfg(root=str(plain_tree), split_seed=1), tmp_path / "c")
    assert set(map(tuple, read_index(tmp_path / "c")["test"])) != set(splits["test"])

    inputs, labels = load_split(tmp_path / "a", "test").batch([0, 4])
    assert inputs.shape == (2, 3, 16, 16) and labels.tolist() == [splits["test"][0][1], splits["test"][4][1]]


def test_plain_tree_check_stays_torch_free(plain_tree):
    code = (
        "import sys; from dtstudy.data.checks import check_dataset; "
        f"n = check_dataset({make_cfg(root=str(plain_tree))!r}); "
        "assert n == 22, n; assert 'torch' not in sys.modules and 'PIL' not in sys.modules"
    )
    env = {"PYTHONPATH": str(REPO / "workflow")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_test_fraction_that_empties_a_class_or_the_test_split(tmp_path):
    root = tmp_path / "small"
    write_images(root / "a", 1, seed=1)
    write_images(root / "b", 1, seed=2)
    message = error_of(check_dataset, make_cfg(root=str(root), test_fraction=0.2))
    assert "dataset.test_fraction" in message and "0.2" in message and "no test image" in message
    message = error_of(check_dataset, make_cfg(root=str(root), test_fraction=0.9))
    assert "dataset.test_fraction" in message and str(root / "a") in message and "none for training" in message


# ------------------------------------------------------------------- train/ layouts


def test_train_with_test_or_val_folder_and_train_alone(tmp_path):
    root = tmp_path / "split"
    for cls, seed in (("cat", 1), ("dog", 2)):
        write_images(root / "train" / cls, 5, seed=seed)
        write_images(root / "test" / cls, 2, seed=seed + 10)
    cfg = make_cfg(root=str(root), val_fraction=0.2)
    assert check_dataset(cfg) == 10  # test/ is the test split: nothing held out of train/
    meta = prepare(cfg, tmp_path / "with_test")
    index = read_index(tmp_path / "with_test")
    assert meta["layout"] == "split" and meta["test_source"] == "test/" and meta["test_fraction"] is None
    assert sorted(path for path, _ in index["test"]) == sorted(
        f"test/{cls}/img{i:02d}.png" for cls in ("cat", "dog") for i in range(2)
    )
    assert sorted(path for path, _ in index["train"] + index["val"]) == sorted(
        f"train/{cls}/img{i:02d}.png" for cls in ("cat", "dog") for i in range(5)
    )

    (root / "test").rename(root / "val")
    meta = prepare(cfg, tmp_path / "with_val")
    assert meta["test_source"] == "val/" and meta["sizes"]["test"] == 4

    # train/ alone: the test split is held out of it (it used to be empty)
    (root / "val").rename(tmp_path / "elsewhere")
    assert check_dataset(cfg) == 8  # round(0.2 * 5) = 1 per class held out
    meta = prepare(cfg, tmp_path / "train_only")
    index = read_index(tmp_path / "train_only")
    assert meta["test_source"] == "held out" and meta["sizes"]["test"] == 2
    assert sorted(label for _, label in index["test"]) == [0, 1]
    used = [path for split in SPLITS for path, _ in index[split]]
    assert sorted(used) == sorted(f"train/{p}" for p in all_files(root / "train"))


def test_test_folder_without_train_folder(tmp_path):
    write_images(tmp_path / "test" / "cat", 2, seed=1)
    message = error_of(check_dataset, make_cfg(root=str(tmp_path)))
    assert "dataset.root" in message and str(tmp_path) in message and "test/ folder but no train/" in message


# ------------------------------------------------------------- empty and single class


@pytest.mark.parametrize("layout", ["plain", "split"])
def test_empty_class_folder(tmp_path, layout):
    root = tmp_path / "tree"
    classes = root if layout == "plain" else root / "train"
    write_images(classes / "cat", 3, seed=1)
    write_images(classes / "dog", 3, seed=2)
    (classes / "empty" / "sub").mkdir(parents=True)
    (classes / "empty" / "notes.txt").write_text("no images here")
    message = error_of(check_dataset, make_cfg(root=str(root)))
    assert "dataset.root" in message and str(classes / "empty") in message and "no images" in message


@pytest.mark.parametrize("layout", ["plain", "split"])
def test_one_class(tmp_path, layout):
    root = tmp_path / "tree"
    classes = root if layout == "plain" else root / "train"
    write_images(classes / "cat", 6, seed=1)
    message = error_of(check_dataset, make_cfg(root=str(root)))
    assert "dataset.root" in message and str(classes) in message and "one class folder (cat/)" in message


# ---------------------------------------------------------------- corrupt images


@pytest.fixture
def tree_with_bad_images(tmp_path):
    """train/ + test/ with a cut JPEG, a PNG of garbage bytes and a dangling link, all image-named."""
    root = tmp_path / "bad"
    write_images(root / "train" / "cat", 6, seed=1)
    write_images(root / "train" / "dog", 6, seed=2)
    write_images(root / "test" / "cat", 2, seed=3)
    write_images(root / "test" / "dog", 2, seed=4)
    jpeg = root / "train" / "dog" / "cut.jpg"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(jpeg)
    jpeg.write_bytes(jpeg.read_bytes()[: jpeg.stat().st_size // 2])
    (root / "train" / "cat" / "garbage.png").write_bytes(b"not a png at all" * 10)
    os.symlink(root / "gone.png", root / "test" / "dog" / "dangling.png")
    bad = ["test/dog/dangling.png", "train/cat/garbage.png", "train/dog/cut.jpg"]
    return root, bad


def test_corrupt_images_error_names_count_and_files(tree_with_bad_images, tmp_path):
    root, bad = tree_with_bad_images
    cfg = make_cfg(root=str(root), val_fraction=0.2)
    assert check_dataset(cfg) == 14  # parse time lists files only; prepare decodes them
    message = error_of(prepare, cfg, tmp_path / "out")
    assert "dataset.root" in message and "dataset.corrupt_images" in message
    assert "3 image(s)" in message and all(path in message for path in bad)
    assert not (tmp_path / "out" / "meta.json").exists() and not (tmp_path / "out" / "index.json").exists()


def test_corrupt_images_skip_leaves_them_out_and_reports_them(tree_with_bad_images, tmp_path, capsys):
    root, bad = tree_with_bad_images
    meta = prepare(make_cfg(root=str(root), val_fraction=0.2, corrupt_images="skip"), tmp_path)
    assert meta["skipped_images"] == 3 and sorted(meta["skipped_examples"]) == bad
    assert json.loads((tmp_path / "meta.json").read_text())["skipped_images"] == 3
    index = read_index(tmp_path)
    assert sorted(path for path, _ in index["skipped"]) == bad
    used = [path for split in SPLITS for path, _ in index[split]]
    assert sorted(used) == sorted(all_files(root) - set(bad))
    assert meta["sizes"] == {"train": 10, "val": 2, "test": 4}
    assert "skipped 3 unreadable or corrupt image(s)" in capsys.readouterr().out


# ---------------------------------------------------------------- truncated files


def write_idx(path: Path, array: np.ndarray, packed: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    raw = header + array.astype(np.uint8).tobytes()
    if packed:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


@pytest.fixture(params=["unpacked", "gz"])
def small_idx_root(tmp_path, request):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (20, 28, 28)),
        "train_labels": rng.integers(0, 10, 20),
        "test_images": rng.integers(0, 256, (10, 28, 28)),
        "test_labels": rng.integers(0, 10, 10),
    }
    for key, array in arrays.items():
        write_idx(tmp_path / FASHION_MNIST_FILES[key], array, packed=request.param == "gz")
    return tmp_path, request.param


@pytest.mark.parametrize("key", ["train_images", "test_labels"])
def test_truncated_idx_file(small_idx_root, key):
    root, packing = small_idx_root
    cfg = make_cfg(name="fashion_mnist", root=str(root), val_fraction=0.1)
    assert check_dataset(cfg) == 20
    path = root / (FASHION_MNIST_FILES[key] + (".gz" if packing == "gz" else ""))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 5])  # a download cut short
    message = error_of(check_dataset, cfg)
    assert "dataset.root" in message and str(path) in message and "truncated" in message


CIFAR_BATCH = 4  # images per fake batch file (the real ones hold 10000)


@pytest.fixture
def fake_cifar(tmp_path):
    """cifar-10-batches-py/ in its real pickle format, CIFAR_BATCH images per batch."""
    folder = tmp_path / CIFAR10_DIR
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name in CIFAR10_FILES[:-1]:
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, CIFAR_BATCH).tolist(),
            "data": rng.integers(0, 256, (CIFAR_BATCH, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(CIFAR_BATCH)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        batches[name] = entry
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": list("abcdefghij")}, protocol=2))
    return tmp_path, batches


def test_fake_cifar_prepares_exactly(fake_cifar, tmp_path):
    root, batches = fake_cifar
    meta = prepare(make_cfg(name="cifar10", root=str(root), val_fraction=0.25), tmp_path / "out")
    assert meta["sizes"] == {"train": 15, "val": 5, "test": 4}
    test = torch.load(tmp_path / "out" / "test.pt", weights_only=True)
    expected = batches["test_batch"]["data"].reshape(-1, 3, 32, 32)
    assert torch.equal(test["images"], torch.from_numpy(expected))
    assert test["labels"].tolist() == batches["test_batch"]["labels"]


def test_truncated_cifar_batch_caught_at_parse_time(fake_cifar):
    root, _ = fake_cifar
    path = root / CIFAR10_DIR / "data_batch_3"
    raw = path.read_bytes()
    cut = len(raw) // 2
    while raw[cut - 1 : cut] == PICKLE_STOP:  # a cut that does not end on pickle's end marker
        cut -= 1
    path.write_bytes(raw[:cut])
    message = error_of(check_dataset, make_cfg(name="cifar10", root=str(root)))
    assert "dataset.root" in message and str(path) in message and "truncated" in message


def test_truncated_cifar_batch_ending_like_a_pickle_caught_in_prepare(fake_cifar, tmp_path):
    root, _ = fake_cifar
    path = root / CIFAR10_DIR / "test_batch"
    raw = path.read_bytes()
    cut = raw.index(PICKLE_STOP, len(raw) // 2) + 1  # cut inside the pixels, just after a b"."
    assert cut < len(raw)
    path.write_bytes(raw[:cut])
    cfg = make_cfg(name="cifar10", root=str(root), val_fraction=0.25)
    check_dataset(cfg)  # the one-byte check cannot see this cut
    message = error_of(prepare, cfg, tmp_path / "out")
    assert "dataset.root" in message and str(path) in message and "truncated" in message
    assert not (tmp_path / "out" / "meta.json").exists()
