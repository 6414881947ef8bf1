"""Image folders: the listing of an imagefolder root, its held-out test split, and which images decode."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dtstudy.data.errors import DataConfigError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class _ImageTree:
    """An imagefolder root as listed on disk: its classes, and where its test split comes from."""

    root: Path
    layout: str  # "plain" (root/<class>/<image>) or "split" (root/train/<class>/<image>)
    train: dict[str, list[str]]  # class -> image paths relative to root, as ImageFolder lists them
    test: dict[str, list[str]] | None  # from test/ (or else val/); None: held out of train
    test_source: str  # "test/", "val/" or "held out"


def image_tree(cfg: dict) -> _ImageTree:
    """List an imagefolder root (names only, no image is opened); DataConfigError if it cannot work."""
    if cfg["root"] is None:
        raise DataConfigError(
            "dataset.root: null is not allowed for imagefolder (a folder of <class>/<image> "
            "folders, or one with train/<class>/ and optionally test/ or val/)"
        )
    root = Path(cfg["root"])
    if not root.is_dir():
        raise DataConfigError(
            f"dataset.root: '{root}' is not a folder (a folder of <class>/<image> folders, "
            "or one with train/<class>/ and optionally test/ or val/)"
        )
    if (root / "train").is_dir():
        layout, train_dir = "split", root / "train"
        test_dir = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
    else:
        for name in ("test", "val"):
            if (root / name).is_dir():
                raise DataConfigError(
                    f"dataset.root: '{root}' has a {name}/ folder but no train/ (give train/<class>/ "
                    f"beside {name}/, or a folder whose sub-folders are all classes)"
                )
        layout, train_dir, test_dir = "plain", root, None
    train = _class_files(train_dir, root)
    if len(train) < 2:
        raise DataConfigError(
            f"dataset.root: '{train_dir}' has one class folder ({next(iter(train))}/); a classifier "
            "needs at least 2 (one sub-folder per class)"
        )
    test = None
    if test_dir is not None:
        test = _class_files(test_dir, root)
        unknown = [name for name in test if name not in train]
        if unknown:
            raise DataConfigError(
                f"dataset.root: class folder '{test_dir / unknown[0]}' has no counterpart in "
                f"'{train_dir}' (the test classes must be training classes)"
            )
    test_source = "held out" if test_dir is None else f"{test_dir.name}/"
    return _ImageTree(root, layout, train, test, test_source)


def _class_files(folder: Path, root: Path) -> dict[str, list[str]]:
    """Class name -> sorted image paths relative to root, found as torchvision's ImageFolder finds them.

    Classes are the sorted sub-folder names (hidden ones too, as ImageFolder), files are
    walked recursively and kept by extension; a class without images is an error, as there.
    """
    classes = {}
    for name in sorted(entry.name for entry in os.scandir(folder) if entry.is_dir()):
        files = []
        for dirpath, _, filenames in sorted(os.walk(folder / name, followlinks=True)):
            files += [
                (Path(dirpath) / file).relative_to(root).as_posix()
                for file in sorted(filenames)
                if file.lower().endswith(IMAGE_EXTENSIONS)
            ]
        classes[name] = files
    if not classes:
        raise DataConfigError(f"dataset.root: '{folder}' has no class folders (expected {folder}/<class>/<image>)")
    empty = [name for name, files in classes.items() if not files]
    if empty:
        raise DataConfigError(
            f"dataset.root: {len(empty)} class folder(s) hold no images, e.g. '{folder / empty[0]}' "
            f"(images are files ending in {', '.join(IMAGE_EXTENSIONS)}); add images or remove the folder"
        )
    return classes


def held_out_counts(tree: _ImageTree, cfg: dict) -> dict[str, int]:
    """Class -> test images held out of it: round(test_fraction * class size) (a stratified split)."""
    fraction = cfg["test_fraction"]
    counts = {name: round(fraction * len(files)) for name, files in tree.train.items()}
    whole = [name for name, n in counts.items() if n == len(tree.train[name])]
    if whole:
        raise DataConfigError(
            f"dataset.test_fraction: {fraction} of the {len(tree.train[whole[0]])} images of "
            f"'{tree.root / whole[0]}' leaves none for training (lower it, or add a test/ folder)"
        )
    if sum(counts.values()) == 0:
        raise DataConfigError(
            f"dataset.test_fraction: {fraction} of each class of '{tree.root}' holds out no test "
            "image (raise it, add images, or add a test/ folder)"
        )
    return counts


def hold_out_test(tree: _ImageTree, cfg: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(train, test) files per class: each class's test files drawn by a split_seed permutation."""
    import torch

    counts = held_out_counts(tree, cfg)
    generator = torch.Generator().manual_seed(cfg["split_seed"])
    train, test = {}, {}
    for name, files in tree.train.items():  # class order fixed, so the draws are too
        perm = torch.randperm(len(files), generator=generator).tolist()
        held = set(perm[: counts[name]])
        # both keep the listing's order, as a test/ folder would
        test[name] = [path for i, path in enumerate(files) if i in held]
        train[name] = [path for i, path in enumerate(files) if i not in held]
    return train, test


def _image_problem(path: Path) -> str | None:
    """Why the image at path cannot be used in training (the message of its error), or None."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.draft("RGB", (1, 1))  # JPEG: decode at 1/8 scale, still reading the whole stream
            image.load()
    except Exception as err:  # noqa: BLE001 - whatever PIL raises here, training would raise too
        return f"{type(err).__name__}: {err}"
    return None


def decodable(root: Path, samples: list, limit: int | None = None) -> tuple[list, list[tuple[str, str]]]:
    """(the first `limit` (default all) samples whose image decodes, [(path, why)] of those that do not)."""
    from concurrent.futures import ThreadPoolExecutor

    good, bad = [], []
    chunk = 512  # decode in chunks, so that a small subset does not decode the whole tree
    # threads: PIL's decoders release the GIL
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for start in range(0, len(samples), chunk):
            part = samples[start : start + chunk]
            for sample, problem in zip(part, pool.map(lambda s: _image_problem(root / s[0]), part)):
                if limit is not None and len(good) == limit:
                    return good, bad
                if problem is None:
                    good.append(sample)
                else:
                    bad.append((sample[0], problem))
    return good, bad
