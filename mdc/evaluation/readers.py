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
import pickle
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.folder import find_classes, make_dataset

from mdc.data import shards, storage
from mdc.data.images import decode_image

log = logging.getLogger(__name__)

ImageSource = str | bytes | np.ndarray  # a file path, encoded image bytes, or (H, W[, C]) uint8
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


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
    """The sorted class folders of `directory`, as torchvision's ImageFolder finds them."""
    if not directory.is_dir():
        raise DatasetFormatError(f"{directory} not found (expected one folder per class)")
    try:
        return find_classes(directory)[0]
    except FileNotFoundError:  # torchvision: no class folder in it
        raise DatasetFormatError(f"{directory}: no class folders (expected one folder per class)") from None


def _folder_split(train_dir: Path, split_dir: Path, name: str) -> Split:
    """Images under split_dir/CLASS/, sub-folders too (torchvision's `make_dataset`); class ids from
    the class folders of the training split, so both splits agree even where one of them lacks a class."""
    class_names = _class_dirs(train_dir)
    missing = sorted(set(_class_dirs(split_dir)) - set(class_names))
    if missing:
        raise DatasetFormatError(f"{split_dir}: class folders {missing[:5]} are not in {train_dir}")
    class_ids = {c: i for i, c in enumerate(class_names)}
    samples = make_dataset(split_dir, class_ids, IMAGE_SUFFIXES, allow_empty=True)
    if not samples:
        raise DatasetFormatError(f"{split_dir}: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders")
    sources, labels = zip(*samples)
    return Split(name, list(sources), np.asarray(labels, dtype=np.int64), class_names)


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
            raise DatasetFormatError(
                f"{listing}:{n}: entry {entry!r} lacks the field CLASS (CLASS/ID, CLASS from {classes_file.name})"
            )
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


def _without_md5(dataset: type[CIFAR10]) -> type[CIFAR10]:
    """torchvision's `dataset` reading the batches in its `root` itself (not root/cifar-...-py) and
    checking that they exist, not their md5s: those identify the official download, which the project
    never makes, and its tests write small batches in the same layout. A damaged batch still fails,
    when it is unpickled or reshaped."""
    return type(
        dataset.__name__,
        (dataset,),
        {
            "base_folder": "",
            "train_list": [[file, None] for file, _ in dataset.train_list],
            "test_list": [[file, None] for file, _ in dataset.test_list],
            "meta": {**dataset.meta, "md5": None},
        },
    )


def _cifar(dataset: type[CIFAR10], root: str, split: str, label_field: str, name: str) -> Split:
    """A CIFAR split read by torchvision, its errors turned into ones that name the file and field."""
    base = _locate(root, dataset.base_folder, dataset.meta["filename"])
    split_files = [file for file, _ in (dataset.train_list if split == "train" else dataset.test_list)]
    where = base / split_files[0] if len(split_files) == 1 else f"{base}/{{{','.join(split_files)}}}"
    try:
        data = _without_md5(dataset)(base, train=split == "train")
    except RuntimeError:  # torchvision: "Dataset not found or corrupted": a file is missing
        expected = [file for file, _ in dataset.train_list + dataset.test_list] + [dataset.meta["filename"]]
        missing = [file for file in expected if not (base / file).is_file()]
        raise DatasetFormatError(f"{base}: {', '.join(missing)} not found (expected {', '.join(expected)})") from None
    except KeyError as e:
        field = e.args[0]
        if field == dataset.meta["key"]:
            raise DatasetFormatError(f"{base / dataset.meta['filename']}: missing field {field!r}") from None
        missing = "data" if field == "data" else label_field  # torchvision falls back to "fine_labels"
        raise DatasetFormatError(f"{where}: missing field {missing!r}") from None
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise DatasetFormatError(f"{where}: not a CIFAR python batch ({e})") from None
    return Split(name, data.data, np.asarray(data.targets, dtype=np.int64), list(data.classes))


@register("cifar10")
def cifar10(root: str, split: str) -> Split:
    """CIFAR-10 python batches: data_batch_1..5 / test_batch, names in batches.meta."""
    return _cifar(CIFAR10, root, split, "labels", f"cifar10/{split}")


@register("cifar100")
def cifar100(root: str, split: str) -> Split:
    """CIFAR-100 python files: train / test with the 100 fine labels, names in meta."""
    return _cifar(CIFAR100, root, split, "fine_labels", f"cifar100/{split}")


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """An idx file (MNIST format; gzipped or not) as a uint8 array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    (found,) = struct.unpack(">I", data[:4])
    if found != magic:
        raise DatasetFormatError(f"{path}: magic number {found:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
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
    """A dataset written by `mdc data shapes|tuxpaint|emoji`: train/ for fitting, test/ (val/ where
    there is no test/) as the test split, label = the sample's JSON field and class names the
    manifest's field that SHARD_LABELS names for `kind` (`label` and `class_names` by default)."""
    label_field, names_field = SHARD_LABELS.get(kind, ("label", "class_names"))
    manifest = shards.read_manifest(uri, endpoint_url)
    class_names = manifest.get(names_field)
    if not class_names:
        raise DatasetFormatError(f"{storage.join(uri, shards.MANIFEST)}: missing field {names_field!r}")
    held_out = "test" if "test" in manifest.get("splits", {}) else "val"
    split_uri = storage.join(uri, "train" if split == "train" else held_out)
    skips = Counter()
    sources, labels = [], []
    for sample in shards.read_shards(split_uri, endpoint_url, skips):
        if not isinstance(sample.meta, dict) or label_field not in sample.meta:
            raise DatasetFormatError(
                f"{split_uri}: sample {sample.key}: missing field {label_field!r} in {sample.key}.json"
            )
        sources.append(sample.image)
        labels.append(int(sample.meta[label_field]))
    if skips:
        log.warning("%s: skipped %s", split_uri, dict(skips))
    return Split(f"{kind}/{split}", sources, np.asarray(labels, dtype=np.int64), list(class_names))


SHARD_DATASETS = ("shapes", "tuxpaint", "emoji", "emoji-subgroup")
# kind -> (the sample JSON's label field, the manifest's class-names field); others: label, class_names
SHARD_LABELS = {"emoji-subgroup": ("subgroup_label", "subgroup_names")}
