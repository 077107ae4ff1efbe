"""Ray Data ingest: shards in object storage → decoded images + caption tokens, streamed.

list shards → read (whole tar files as bytes, or Parquet row groups) → parse samples → decode,
resize and tokenize in an actor pool → `iter_torch_batches` in each Ray Train worker. Nothing is
materialised, so memory does not grow with the number of shards. Bad records are dropped where they
are found and counted by reason in one `SkipCounter` actor, which the driver reads at the end.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import ray

from mdc import shards, storage
from mdc.images import preprocess_batch
from mdc.tokenizer import CaptionTokenizer

SHARD_SUFFIXES = (".tar", ".parquet")


@ray.remote(num_cpus=0)
class SkipCounter:
    """Distinct skipped records by reason, over every read and decode task. Each record has an
    identity (shard and key, or shard and position), so a shard read again in a later epoch is
    not counted twice."""

    def __init__(self):
        self.seen = defaultdict(set)

    def add(self, ids_by_reason: dict[str, list[str]]) -> None:
        for reason, ids in ids_by_reason.items():
            self.seen[reason].update(ids)

    def get(self) -> dict[str, int]:
        return {reason: len(ids) for reason, ids in sorted(self.seen.items())}


def _report(counter, skips: Counter, scope: str) -> None:
    """Counts from parsing one deterministic unit (`scope`) become per-record identities."""
    if counter is not None and any(skips.values()):
        counter.add.remote({reason: [f"{scope}#{i}" for i in range(n)] for reason, n in skips.items()})


def _rows(samples) -> dict:
    samples = list(samples)
    return {"key": np.array([s.key for s in samples], dtype=object),
            "jpg": np.array([s.image for s in samples], dtype=object),
            "txt": np.array([s.caption for s in samples], dtype=object)}


class Subset:
    """Nested deterministic subsets: a key is kept when its hash is below `fraction`, so the
    5M-pair subset lies inside the 10M one whatever the shard layout."""

    def __init__(self, fraction: float | None, salt: str):
        self.fraction, self.salt = fraction, salt

    def __call__(self, samples):
        if self.fraction is None:
            return list(samples)
        return [s for s in samples if shards.key_fraction(s.key, self.salt) < self.fraction]


class ParseTar:
    """One whole tar file (as bytes) → its samples; damaged files yield what precedes the damage."""

    def __init__(self, counter, subset: Subset):
        self.counter, self.subset = counter, subset

    def __call__(self, row: dict) -> list[dict]:
        skips = Counter()
        samples = self.subset(shards.iter_tar_bytes(row["bytes"], row["path"], skips))
        _report(self.counter, skips, row["path"])
        return [{"key": s.key, "jpg": s.image, "txt": s.caption} for s in samples]


class ParseParquet:
    """Parquet rows → the same (key, jpg, txt) rows as tars, with the same caption checks."""

    def __init__(self, counter, subset: Subset):
        self.counter, self.subset = counter, subset

    def __call__(self, table) -> dict:
        skips = Counter()
        source = table["path"][0].as_py() if table.num_rows else "parquet"
        batch = _rows(self.subset(shards.iter_parquet_table(table.drop_columns(["path"]), source, skips)))
        _report(self.counter, skips, f"{source}@{table['key'][0].as_py() if 'key' in table.column_names else ''}")
        return batch


class DecodeAndTokenize:
    """Actor-pool stage: holds the tokenizer; drops undecodable images and counts them."""

    def __init__(self, image_size: int, max_length: int, counter):
        self.image_size = image_size
        self.tokenizer = CaptionTokenizer(max_length)
        self.counter = counter

    def __call__(self, batch: dict) -> dict:
        images, ok = preprocess_batch(list(batch["jpg"]), self.image_size)
        ok = np.asarray(ok, dtype=bool)
        if self.counter is not None and not ok.all():
            self.counter.add.remote({shards.UNDECODABLE_IMAGE: [str(k) for k in batch["key"][~ok]]})
        captions = [str(c) for c in np.asarray(batch["txt"])[ok]]
        tokens = self.tokenizer.encode(captions) if captions else np.zeros((0, self.tokenizer.max_length), np.int64)
        return {"image": images[ok], "tokens": tokens}


def build_dataset(uri: str, image_size: int, max_length: int, counter=None,
                  endpoint_url: str | None = None, tokenizer_actors: int = 1,
                  shuffle_files: bool = True, cpus: float = 0.25, subset_fraction: float | None = None,
                  subset_salt: str = "subset") -> ray.data.Dataset:
    """A streaming dataset of {"image": (3,S,S) float32, "tokens": (L,) int64} from shards at `uri`.

    `cpus` is the logical CPU share of each read/parse/decode task or actor: small values keep a
    2-core machine from deadlocking between training workers and ingest.
    """
    files = storage.list_files(uri, SHARD_SUFFIXES, endpoint_url)
    if not files:
        raise storage.StorageError(f"no .tar or .parquet shards under {uri}")
    fs, _ = storage.open_fs(uri, endpoint_url)
    paths = [storage.open_fs(f, endpoint_url)[1] for f in files]
    tars = [p for p in paths if p.endswith(".tar")]
    parquets = [p for p in paths if p.endswith(".parquet")]
    shuffle = "files" if shuffle_files else None
    subset = Subset(subset_fraction, subset_salt)
    parts = []
    if tars:
        parts.append(ray.data.read_binary_files(tars, filesystem=fs, include_paths=True, shuffle=shuffle,
                                               num_cpus=cpus)
                     .flat_map(ParseTar(counter, subset), num_cpus=cpus))
    if parquets:
        parts.append(ray.data.read_parquet(parquets, filesystem=fs, include_paths=True, shuffle=shuffle,
                                          num_cpus=cpus)
                     .map_batches(ParseParquet(counter, subset), batch_format="pyarrow", num_cpus=cpus))
    ds = parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])
    return ds.map_batches(
        DecodeAndTokenize, fn_constructor_args=(image_size, max_length, counter),
        batch_size=64, batch_format="numpy", num_cpus=cpus,
        compute=ray.data.ActorPoolStrategy(size=tokenizer_actors),
    )
