"""Tar shards of an imagefolder tree (`dataset.shard_mb`, dtstudy.data.storage): prepare_data
packs every split's files, byte for byte and in WebDataset's layout; training and evaluation
read the same pixels from the shards as from the files, in worker processes too; the key is
refused where it cannot apply; a preparation without shards removes the old ones."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import dataset_config
from test_image_pipeline import SIZE, loader_config, write_messy_tree

from dtstudy.data.augment import Draws
from dtstudy.data.checks import check_dataset
from dtstudy.data.errors import DataConfigError
from dtstudy.data.loading import load_split
from dtstudy.data.prepare import SPLITS, prepare, prepared_files
from dtstudy.data.storage import SHARDS_DIR, SHARDS_INDEX, ShardStore

SHARD_MB = 0.008  # about 8 KB: a few of the tree's small files per shard, so every split has several


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_messy_tree(tmp_path_factory.mktemp("tree") / "root", per_class=10, seed=4)


def config(tree: Path, shard_mb=None) -> dict:
    return dataset_config(
        name="imagefolder", root=str(tree), val_fraction=0.2, test_fraction=0.2, image_size=SIZE, shard_mb=shard_mb
    )


@pytest.fixture(scope="module")
def prepared(tree, tmp_path_factory) -> dict[str, Path]:
    """The tree prepared twice: images left in their files, and packed into shards."""
    out = {"files": tmp_path_factory.mktemp("files"), "shards": tmp_path_factory.mktemp("shards")}
    prepare(config(tree), out["files"])
    prepare(config(tree, SHARD_MB), out["shards"])
    return out


def test_every_split_is_packed_byte_for_byte_in_webdatasets_layout(tree, prepared):
    data = prepared["shards"]
    index = json.loads((data / "index.json").read_text())
    shards = json.loads((data / SHARDS_INDEX).read_text())
    meta = json.loads((data / "meta.json").read_text())
    assert meta["shards"] == {"shard_mb": SHARD_MB, "count": len(shards["files"]), "folder": SHARDS_DIR}
    assert set(prepared_files(config(tree, SHARD_MB))) == {"meta.json", "index.json", SHARDS_INDEX}
    for split in SPLITS:
        names = [name for name in shards["files"] if name.startswith(f"{split}-")]
        assert len(names) >= 2, f"{split}: {names}"  # the size limit cut the split
        members = {}
        for name in names:
            with tarfile.open(data / SHARDS_DIR / name) as tar:
                members.update({member.name: tar.extractfile(member).read() for member in tar.getmembers()})
        assert len(members) == 2 * len(index[split])  # an image and its label per sample
        for i, (path, label) in enumerate(index[split]):
            assert members[f"{i:08d}.jpeg"] == (tree / path).read_bytes()
            assert members[f"{i:08d}.cls"] == str(label).encode()
        store = ShardStore(data / SHARDS_DIR, shards["files"], shards["locations"][split])
        for i, (path, _) in enumerate(index[split]):
            assert store.read(i).tobytes() == (tree / path).read_bytes()
        # control: a location one byte off reads other bytes
        shard, offset, size = shards["locations"][split][0]
        off = ShardStore(data / SHARDS_DIR, shards["files"], [[shard, offset + 1, size]])
        assert off.read(0).tobytes() != (tree / index[split][0][0]).read_bytes()


@pytest.mark.parametrize("workers", [0, 2])
def test_training_and_evaluation_read_the_same_pixels_from_shards_as_from_files(prepared, workers):
    def pixels(form: str, split: str, seed: int) -> torch.Tensor:
        data = load_split(prepared[form], split, loader_config(workers=workers))
        return torch.cat([inputs for inputs, _ in data.batches([range(0, 5), range(5, len(data))], Draws(seed))])

    for split in ("train", "test"):
        assert torch.equal(pixels("shards", split, 0), pixels("files", split, 0))
    assert not torch.equal(pixels("shards", "train", 0), pixels("files", "train", 1))  # control
    test = {form: load_split(prepared[form], "test") for form in prepared}
    assert isinstance(test["shards"].store, ShardStore)
    assert torch.equal(test["shards"].batch(range(4))[0], test["files"].batch(range(4))[0])


def test_a_process_keeps_at_most_max_open_shards_open(tree, prepared, monkeypatch):
    """Reading across more shards than the cap closes the least recently read, and every
    read still gives the file's bytes (a closed shard is opened again)."""
    from dtstudy.data import storage

    monkeypatch.setattr(storage, "MAX_OPEN_SHARDS", 2)
    data = prepared["shards"]
    index = json.loads((data / "index.json").read_text())
    shards = json.loads((data / SHARDS_INDEX).read_text())
    store = ShardStore(data / SHARDS_DIR, shards["files"], shards["locations"]["train"])
    used = {shard for shard, _, _ in shards["locations"]["train"]}
    assert len(used) > 2  # control: the split spans more shards than the cap
    for _ in range(2):  # twice round: shards closed by the cap are opened again
        for i, (path, _) in enumerate(index["train"]):
            assert store.read(i).tobytes() == (tree / path).read_bytes()
            assert len(store._open[1]) <= 2
    last = shards["locations"]["train"][-1][0]
    assert last in store._open[1] and len(store._open[1]) == 2


def test_a_truncated_shard_is_named(prepared, tmp_path):
    shards = json.loads((prepared["shards"] / SHARDS_INDEX).read_text())
    shard, offset, size = shards["locations"]["train"][-1]
    cut = tmp_path / shards["files"][shard]
    cut.write_bytes((prepared["shards"] / SHARDS_DIR / shards["files"][shard]).read_bytes()[: offset + size - 1])
    store = ShardStore(tmp_path, shards["files"], [[shard, offset, size]])
    with pytest.raises(OSError, match=rf"{cut.name}' ends before byte {offset + size}.*prepare_data"):
        store.read(0)


def test_preparing_without_shards_removes_the_old_ones(tree, tmp_path):
    prepare(config(tree, SHARD_MB), tmp_path)
    assert (tmp_path / SHARDS_INDEX).exists() and any((tmp_path / SHARDS_DIR).iterdir())
    meta = prepare(config(tree), tmp_path)
    assert meta["shards"] is None
    assert not (tmp_path / SHARDS_INDEX).exists() and not (tmp_path / SHARDS_DIR).exists()
    assert load_split(tmp_path, "train").store.__class__.__name__ == "FileStore"


def test_shard_mb_is_refused_where_it_cannot_apply():
    from dtstudy.config.study_config import validate_schema

    with pytest.raises(DataConfigError, match=r"dataset\.shard_mb: 64 applies to imagefolder only.*null"):
        check_dataset(dataset_config(name="synthetic", shard_mb=64))
    check_dataset(dataset_config(name="synthetic"))  # control: null is fine
    for bad in (0, -1, "64"):
        with pytest.raises(Exception, match="shard_mb"):
            validate_schema({"dataset": {"shard_mb": bad}})
