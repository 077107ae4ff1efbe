"""Labelled image datasets in their standard on-disk layouts, read from a local root (never
downloaded), for linear probes and zero-shot classification.

A reader returns one `Split`: image *sources* (file paths, encoded bytes or uint8 arrays) that are
decoded a batch at a time by `load_image`, so ImageNet's 1.3M images are a list of paths, not pixels.
Labels are integers into `class_names`, which are the same for the train and the test split.
A file that lacks a field, or names an image that does not exist, raises `DatasetFormatError`
naming the file and the field.
"""

from __future__ import annotations

import csv
import gzip
import logging
import os
import pickle
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
from PIL import Image

from mdc.data import shards, storage
from mdc.data.images import decode_image

log = logging.getLogger(__name__)

ImageSource = Union[str, bytes, np.ndarray]  # a file path, encoded image bytes, or (H, W[, C]) uint8
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


class DatasetFormatError(ValueError):
    """A dataset file lacks a field or names a missing image; the message names file and field."""


@dataclass
class Split:
    name: str  # "cifar10/train": part of the feature-cache key
    sources: Sequence[ImageSource]
    labels: np.ndarray  # (N,) int64
    class_names: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def load_image(source: ImageSource) -> Image.Image:
    """An RGB PIL image from a path, encoded bytes or a uint8 array (grey arrays become RGB)."""
    if isinstance(source, np.ndarray):
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            source = f.read()
    return decode_image(source)


READERS: dict[str, Callable[[str, str], Split]] = {}  # local layouts; shard datasets: SHARD_DATASETS


def register(*names: str):
    def wrap(fn):
        for name in names:
            READERS[name] = fn
        return fn
    return wrap


def dataset_kinds() -> list[str]:
    return sorted([*READERS, *SHARD_DATASETS])


def read_split(kind: str, root: str, split: str, endpoint_url: str | None = None) -> Split:
    """Split "train" or "test" of dataset `kind` stored under `root` (shard datasets: also s3://)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if kind in SHARD_DATASETS:
        return read_shard_split(root, split, endpoint_url, kind)
    if kind not in READERS:
        raise ValueError(f"unknown dataset {kind!r}; expected one of {dataset_kinds()}")
    return READERS[kind](root, split)


def _locate(root: str, subdir: str, marker: str) -> Path:
    """`root` itself, or `root/subdir` (the name inside the dataset's archive), whichever holds `marker`."""
    for base in (Path(root), Path(root) / subdir):
        if (base / marker).exists():
            return base
    raise FileNotFoundError(f"{Path(root) / marker} not found (nor {Path(root) / subdir / marker})")


def _check_image(path: Path, listing: Path, line: int, field: str) -> str:
    if not path.is_file():
        raise DatasetFormatError(f"{listing}:{line}: field {field!r} names {path}, which does not exist")
    return str(path)


# ------------------------------------------------------------------------------- folder layouts

def _class_dirs(directory: Path) -> list[str]:
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} not found (expected one folder per class)")
    return sorted(d.name for d in os.scandir(directory) if d.is_dir())


def _folder_split(train_dir: Path, split_dir: Path, name: str) -> Split:
    """Images in split_dir/CLASS/*; class ids from the class folders of the training split."""
    class_names = _class_dirs(train_dir)
    missing = sorted(set(_class_dirs(split_dir)) - set(class_names))
    if missing:
        raise DatasetFormatError(f"{split_dir}: class folders {missing[:5]} are not in {train_dir}")
    sources, labels = [], []
    for label, cls in enumerate(class_names):
        folder = split_dir / cls
        if not folder.is_dir():
            continue
        files = sorted(e.path for e in os.scandir(folder) if e.name.lower().endswith(IMAGE_SUFFIXES))
        sources += files
        labels += [label] * len(files)
    if not sources:
        raise DatasetFormatError(f"{split_dir}: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders")
    return Split(name, sources, np.asarray(labels, dtype=np.int64), class_names)


@register("folder")
def image_folder(root: str, split: str) -> Split:
    """ROOT/train/CLASS/* and ROOT/test/CLASS/* (or ROOT/val/CLASS/* for the test split)."""
    base = Path(root)
    split_dir = base / "train"
    if split == "test":
        split_dir = base / "test" if (base / "test").is_dir() else base / "val"
    return _folder_split(base / "train", split_dir, f"folder/{split}")


@register("imagenet")
def imagenet(root: str, split: str) -> Split:
    """ImageNet-1K as class folders: ROOT/train/WNID/*.JPEG, ROOT/val/WNID/*.JPEG (the test split).
    Class names are the WordNet ids (the folder names)."""
    base = Path(root)
    return _folder_split(base / "train", base / ("train" if split == "train" else "val"), f"imagenet/{split}")


@register("food101")
def food101(root: str, split: str) -> Split:
    """Food-101: ROOT/images/CLASS/ID.jpg listed in ROOT/meta/train.txt and test.txt as CLASS/ID;
    class order from meta/classes.txt (alphabetical)."""
    base = _locate(root, "food-101", "meta")
    listing = base / "meta" / f"{split}.txt"
    classes_file = base / "meta" / "classes.txt"
    if not classes_file.is_file():
        raise FileNotFoundError(f"{classes_file} not found")
    class_names = [c.strip() for c in classes_file.read_text().splitlines() if c.strip()]
    index = {c: i for i, c in enumerate(class_names)}
    sources, labels = [], []
    for n, line in enumerate(listing.read_text().splitlines(), start=1):
        entry = line.strip()
        if not entry:
            continue
        cls = entry.split("/", 1)[0]
        if "/" not in entry or cls not in index:
            raise DatasetFormatError(f"{listing}:{n}: entry {entry!r} lacks the field CLASS (CLASS/ID, "
                                     f"CLASS from {classes_file.name})")
        sources.append(_check_image(base / "images" / f"{entry}.jpg", listing, n, "CLASS/ID"))
        labels.append(index[cls])
    return Split(f"food101/{split}", sources, np.asarray(labels, dtype=np.int64), class_names)


@register("pets")
def oxford_pets(root: str, split: str) -> Split:
    """Oxford-IIIT Pets: ROOT/images/NAME.jpg listed in ROOT/annotations/trainval.txt and test.txt
    as `NAME CLASS-ID SPECIES BREED-ID` (CLASS-ID 1..37). The breed name is NAME without `_NUMBER`."""
    base = _locate(root, "oxford-iiit-pet", "annotations")
    listing = base / "annotations" / ("trainval.txt" if split == "train" else "test.txt")
    sources, labels, names = [], [], {}
    for n, line in enumerate(listing.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[1].isdigit():
            raise DatasetFormatError(f"{listing}:{n}: missing field CLASS-ID (expected `NAME CLASS-ID ...`)")
        name, class_id = fields[0], int(fields[1])
        sources.append(_check_image(base / "images" / f"{name}.jpg", listing, n, "NAME"))
        labels.append(class_id - 1)
        names[class_id - 1] = name.rsplit("_", 1)[0]
    class_names = [names.get(i, f"class_{i + 1}") for i in range(max(names) + 1)]
    return Split(f"pets/{split}", sources, np.asarray(labels, dtype=np.int64), class_names)


@register("csv")
def csv_split(root: str, split: str) -> Split:
    """ROOT/train.csv and ROOT/test.csv with a header `path,label`; paths relative to ROOT (or
    absolute); class names are the sorted labels of train.csv."""
    def rows(file: Path) -> list[tuple[int, dict]]:
        with open(file, newline="") as f:
            reader = csv.DictReader(f)
            for field in ("path", "label"):
                if field not in (reader.fieldnames or []):
                    raise DatasetFormatError(f"{file}: missing field {field!r} in the header")
            return list(enumerate(reader, start=2))

    base = Path(root)
    class_names = sorted({row["label"] for _, row in rows(base / "train.csv")})
    index = {c: i for i, c in enumerate(class_names)}
    listing = base / f"{split}.csv"
    sources, labels = [], []
    for n, row in rows(listing):
        if not row["path"] or not row["label"]:
            raise DatasetFormatError(f"{listing}:{n}: empty field {'path' if not row['path'] else 'label'!r}")
        if row["label"] not in index:
            raise DatasetFormatError(f"{listing}:{n}: field 'label' is {row['label']!r}, not a label of train.csv")
        sources.append(_check_image(base / row["path"], listing, n, "path"))
        labels.append(index[row["label"]])
    return Split(f"csv/{split}", sources, np.asarray(labels, dtype=np.int64), class_names)


# ------------------------------------------------------------------------------- array layouts

def _unpickle(path: Path, fields: tuple[str, ...]) -> dict:
    """A CIFAR python batch (a pickled dict with bytes keys); fails naming a missing field."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    with open(path, "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    d = {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}
    for field in fields:
        if field not in d:
            raise DatasetFormatError(f"{path}: missing field {field!r}")
    return d


def _cifar(base: Path, files: list[str], meta: str, label_field: str, names_field: str, name: str) -> Split:
    class_names = [c.decode() if isinstance(c, bytes) else c
                   for c in _unpickle(base / meta, (names_field,))[names_field]]
    images, labels = [], []
    for file in files:
        batch = _unpickle(base / file, ("data", label_field))
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels += list(batch[label_field])
    return Split(name, np.concatenate(images), np.asarray(labels, dtype=np.int64), class_names)


@register("cifar10")
def cifar10(root: str, split: str) -> Split:
    """CIFAR-10 python batches: data_batch_1..5 / test_batch, names in batches.meta."""
    base = _locate(root, "cifar-10-batches-py", "batches.meta")
    files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return _cifar(base, files, "batches.meta", "labels", "label_names", f"cifar10/{split}")


@register("cifar100")
def cifar100(root: str, split: str) -> Split:
    """CIFAR-100 python files: train / test with the 100 fine labels, names in meta."""
    base = _locate(root, "cifar-100-python", "meta")
    return _cifar(base, [split], "meta", "fine_labels", "fine_label_names", f"cifar100/{split}")


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """An idx file (MNIST format; gzipped or not) as a uint8 array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    found, = struct.unpack(">I", data[:4])
    if found != magic:
        raise DatasetFormatError(f"{path}: magic number {found:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@register("fashion-mnist")
def fashion_mnist(root: str, split: str) -> Split:
    """Fashion-MNIST idx files (train-*/t10k-*-ubyte[.gz]); default root: Debian's install path."""
    base = Path(root or FASHION_MNIST_ROOT)
    prefix = "train" if split == "train" else "t10k"

    def find(stem: str) -> Path:
        for candidate in (base / f"{stem}.gz", base / stem):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"{base / stem}[.gz] not found (apt-get install dataset-fashion-mnist)")

    images = _read_idx(find(f"{prefix}-images-idx3-ubyte"), 0x00000803)
    labels = _read_idx(find(f"{prefix}-labels-idx1-ubyte"), 0x00000801)
    if len(images) != len(labels):
        raise DatasetFormatError(f"{base}: {len(images)} {prefix} images but {len(labels)} labels")
    return Split(f"fashion-mnist/{split}", images, labels.astype(np.int64), list(FASHION_MNIST_CLASSES))


# ------------------------------------------------------------------------------- shard datasets

def read_shard_split(uri: str, split: str, endpoint_url: str | None = None, kind: str = "shapes") -> Split:
    """A dataset written by `mdc data shapes|tuxpaint`: train/ for fitting, val/ as the test split,
    label = the sample's JSON `label`, class names from manifest.json."""
    class_names = shards.read_manifest(uri, endpoint_url).get("class_names")
    if not class_names:
        raise DatasetFormatError(f"{storage.join(uri, shards.MANIFEST)}: missing field 'class_names'")
    split_uri = storage.join(uri, "train" if split == "train" else "val")
    skips = Counter()
    sources, labels = [], []
    for sample in shards.read_shards(split_uri, endpoint_url, skips):
        if not isinstance(sample.meta, dict) or "label" not in sample.meta:
            raise DatasetFormatError(f"{split_uri}: sample {sample.key}: missing field 'label' in {sample.key}.json")
        sources.append(sample.image)
        labels.append(int(sample.meta["label"]))
    if skips:
        log.warning("%s: skipped %s", split_uri, dict(skips))
    return Split(f"{kind}/{split}", sources, np.asarray(labels, dtype=np.int64), list(class_names))


SHARD_DATASETS = ("shapes", "tuxpaint")

