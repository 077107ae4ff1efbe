"""Ray Data ingest: shards in object storage → decoded images + caption tokens, streamed.

The shard list is made on the driver (img2dataset's side files left out), read in a seeded order
per epoch (`position.shard_order`), and each shard is read by one `read_shards` task that streams its members (tar) or row batches
(Parquet), shuffles them in seeded windows, parses, decodes, resizes and tokenizes, and yields
batches. One stage of our own replaces Ray's read operators (why: docs/design.md §11, 'Ingest
readers').

For training the rows leave in one order, whatever the number of readers: the shards' seeded
order, each shard's rows in their seeded windows, cut into blocks of exactly one micro-batch
(`rows_per_block`), which Ray Data, told to preserve order, deals to the training workers in turn —
block k to worker k mod W, every block of the epoch dealt. A step's global batch is the next global_batch_size rows of that order
whatever W is (pipelines/data/seeds.py says which of them each rank trains).

The CPUs ingest may use are what the cluster has minus what the training workers hold
(`ingest_resources`), cut into one reader per whole CPU (why: docs/design.md §11, 'Ingest readers'). Each decoded batch leaves its task as its own block, so what a task holds
does not grow with its shard. Bad records are dropped where they are found and counted by reason,
per shard, in one `BadRecordLedgerActor`. Rows carry their shard and place in it, for the data
position a checkpoint stores (`pipelines/data/position.py`), and the run's `EpochPlanActor` tells the
read tasks which epoch they read and, in a resumed epoch, the shards and rows trained before. A training worker that gets no batch for
`data.stall_timeout_s` fails with a `DataStallError` that says which operator has produced nothing
and what it waits for (pipelines/data/feed.py).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train

from mdc.data import shards
from mdc.data.images import preprocess_batch
from mdc.data.tokenizer import CaptionTokenizer
from pipelines.data.position import EpochPlan, shard_order
from pipelines.infra import ray_private
from pipelines.infra.actors import ask

DECODE_BATCH = 64


@dataclass(frozen=True)
class IngestResources:
    """Logical CPUs for ingest beside the training workers, and how they are cut into readers."""

    budget: float
    cpus_per_reader: float
    max_readers: int


def ingest_resources(
    cluster_cpus: float,
    training_cpus: float,
    override: float | None = None,
    held_cpus: float = 0.0,
    eval_cpus: float = 0.0,
) -> IngestResources:
    """Ingest gets what the training workers leave (or `override`, data.ingest_cpus), as one
    reader per whole CPU of it, none asking for more than one CPU: a 2-CPU machine runs one 1-CPU
    reader beside two 0.5-CPU workers and a 64-CPU node runs 56 beside 8 one-CPU workers. CPUs
    that others hold when the run starts (`held_cpus`, e.g. another run at once)
    are left to them, and requests are rounded down to 0.01 CPU, so a reader always fits.
    `eval_cpus` are kept for one online evaluation at a time (eval.cpus)."""
    budget = override if override is not None else cluster_cpus - training_cpus - eval_cpus
    if budget <= 0:
        from mdc.config import ConfigError  # here: read tasks and ingest actors load no config or model stack

        evaluation = f" and online evaluation {eval_cpus:g} (eval.cpus)" if eval_cpus else ""
        raise ConfigError(
            f"no CPU left for data ingest: the cluster has {cluster_cpus:g} CPUs and the training workers "
            f"hold {training_cpus:g}{evaluation}; lower workers.cpus or set data.ingest_cpus"
        )
    usable = budget - held_cpus if budget - held_cpus >= 0.01 else budget  # a holder about to leave waits
    readers = max(1, int(usable + 1e-9))
    return IngestResources(budget, math.floor(min(1.0, usable / readers) * 100) / 100, readers)


class BadRecordLedger:
    """Skipped records by reason, over every shard read. A read task reports a shard's counts once
    it has read the shard to its end, and a shard read again (a later epoch, a resumed one) counts
    what it counted before, so each record is counted once. `by_shard` goes into checkpoints and
    `restore` takes it back, so a relaunched run counts the shards it no longer reads too."""

    def __init__(self):
        self.by_shard: dict[str, dict[str, int]] = {}

    def add(self, shard: str, counts: dict[str, int]) -> None:
        self.by_shard[shard] = dict(counts)

    def restore(self, by_shard: dict[str, dict[str, int]]) -> None:
        for shard, counts in by_shard.items():
            self.by_shard.setdefault(shard, counts)

    def state(self) -> dict[str, dict[str, int]]:
        return self.by_shard

    def get(self) -> dict[str, int]:
        total = Counter()
        for counts in self.by_shard.values():
            total.update(counts)
        return dict(sorted(total.items()))


BadRecordLedgerActor = ray.remote(num_cpus=0)(BadRecordLedger)  # one actor per run, every read task reports to it


class EpochPlanHolder:
    """The `position.EpochPlan` of the epoch being trained: its order, and what a resumed epoch
    passes over. Rank 0 sets it before any rank iterates an epoch; each read task asks once, so a
    passed-over shard is never read (nor its bad records counted again)."""

    def __init__(self):
        self.plan = EpochPlan()

    def set(self, plan: EpochPlan) -> None:
        self.plan = plan

    def get(self) -> EpochPlan:
        return self.plan


EpochPlanActor = ray.remote(num_cpus=0)(EpochPlanHolder)  # one actor per run, every read task asks it


@dataclass(frozen=True, kw_only=True)
class IngestActors:
    """The run's two ingest actors, which only the data cursor talks to."""

    bad_records: Any  # BadRecordLedgerActor: bad-record counts per shard
    epoch_plan: Any  # EpochPlanActor: the epoch the read tasks read, and what they pass over


class ShuffleWindow:
    """A shard's samples shuffled in windows of `size` consecutive ones, each permuted from
    (seed, shard index, window): an order of the dataset, not of the reader or the rank that reads
    it. Samples are still encoded here, so a window costs their compressed bytes."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __call__(self, samples: Iterable[shards.Sample], index: int) -> Iterator[shards.Sample]:
        if self.size <= 1:
            yield from samples
            return
        window, count = [], 0
        for sample in samples:
            window.append(sample)
            if len(window) == self.size:
                yield from self._permuted(window, index, count)
                window, count = [], count + 1
        yield from self._permuted(window, index, count)

    def _permuted(self, window: list, index: int, count: int) -> list:
        order = np.random.default_rng([self.seed, index, count]).permutation(len(window))
        return [window[i] for i in order]


class Subset:
    """Nested deterministic subsets: a key is kept when its hash is below `fraction`, so the
    5M-pair subset lies inside the 10M one whatever the shard layout."""

    def __init__(self, fraction: float | None, salt: str):
        self.fraction, self.salt = fraction, salt

    def __call__(self, samples: Iterable[shards.Sample]) -> Iterator[shards.Sample]:
        return (s for s in samples if self.fraction is None or shards.key_fraction(s.key, self.salt) < self.fraction)


@functools.lru_cache(maxsize=4)
def _tokenizer(max_length: int) -> CaptionTokenizer:
    """One tokenizer per Ray worker process: Ray reuses its processes across tasks and epochs, so
    the load is paid once, not at every epoch as an actor pool's would be."""
    return CaptionTokenizer(max_length)


def _decode(samples: list[shards.Sample], image_size: int, max_length: int, skips: Counter) -> dict:
    images, ok = preprocess_batch([s.image for s in samples], image_size, normalized=False)
    skips[shards.UNDECODABLE_IMAGE] += len(ok) - sum(ok)
    captions = [s.caption for s, good in zip(samples, ok) if good]
    tokens = _tokenizer(max_length).encode(captions) if captions else np.zeros((0, max_length), np.int64)
    return {"image": images[np.asarray(ok, dtype=bool)], "tokens": tokens}


def _tagged(batches: Iterator[dict], index: int) -> Iterator[dict]:
    """A shard's batches with its index and each row's place in it; one batch is held back, so the
    rows of the last one also carry the shard's row count (0 on the others): `pipelines.data.position`."""
    rows, held = 0, None
    for batch in batches:
        n = len(batch["tokens"])
        if n == 0:
            continue
        if held is not None:
            yield held
        held = {
            **batch,
            "shard": np.full(n, index),
            "row": np.arange(rows, rows + n),
            "shard_rows": np.zeros(n, np.int64),
        }
        rows += n
    if held is not None:
        held["shard_rows"][:] = rows
        yield held


def read_shards(
    batch: dict,
    files: tuple[str, ...],
    image_size: int,
    max_length: int,
    ledger,
    endpoint_url: str | None,
    subset: Subset,
    epoch_plan=None,
    shuffle_seed: int | None = None,
    shuffle_window: int = 0,
) -> Iterator[dict]:
    """One task: places in the epoch's shard order in → the samples of the shards there as decoded,
    tokenized batches of DECODE_BATCH, yielded as they fill, so memory holds a batch and one open
    shard whatever the shard's size. The `epoch_plan` actor (an EpochPlanActor; none: epoch 0)
    gives the epoch, whose order `position.shard_order` draws from `shuffle_seed`, the shards not
    to read and the rows already trained of a shard a resumed epoch had begun."""
    plan = ask(epoch_plan.get.remote(), "the EpochPlanActor") if epoch_plan is not None else EpochPlan()
    order, shuffle = shard_order(shuffle_seed, plan.epoch, len(files)), ShuffleWindow(shuffle_window, shuffle_seed or 0)
    for place in batch["place"]:
        index = order[int(place)]
        if index in plan.passed_over:
            continue
        skips = Counter()
        samples = shuffle(subset(shards.iter_shard(files[index], skips, endpoint_url)), index)
        tagged = _tagged(_decoded(samples, files[index], skips, image_size, max_length, ledger), index)
        yield from _from_row(tagged, plan.rows_done.get(index, 0))


def _from_row(batches: Iterator[dict], first: int) -> Iterator[dict]:
    """The tagged batches' rows from row `first` of their shard on (those before it were trained)."""
    for batch in batches:
        if first:
            keep = batch["row"] >= first
            batch = {k: v[keep] for k, v in batch.items()}
        if len(batch["row"]):
            yield batch


def _decoded(
    samples: Iterable[shards.Sample], shard: str, skips: Counter, image_size: int, max_length: int, ledger
) -> Iterator[dict]:
    """One shard's samples as decoded batches; its skip counts go to `ledger` once it is read to
    its end (a read cut short reports nothing: the shard is read again, in full, later)."""
    pending = []
    for sample in samples:
        pending.append(sample)
        if len(pending) == DECODE_BATCH:
            yield _decode(pending, image_size, max_length, skips)
            pending = []
    if pending:
        yield _decode(pending, image_size, max_length, skips)
    if ledger is not None and any(skips.values()):
        ledger.add.remote(shard, +skips)


def build_dataset(
    uri: str,
    image_size: int,
    max_length: int,
    ledger=None,
    endpoint_url: str | None = None,
    resources: IngestResources | None = None,
    shuffle_seed: int | None = 0,
    subset_fraction: float | None = None,
    subset_salt: str = "subset",
    format: shards.ShardFormat = "auto",
    epoch_plan=None,
    files: list[str] | None = None,
    shuffle_window: int = 0,
    rows_per_block: int | None = None,
) -> ray.data.Dataset:
    """A streaming dataset of {"image": (3,S,S) uint8, "tokens": (L,) int64} from shards at `uri`;
    the consumer normalises the pixels (`mdc.data.images.normalize`), where it is cheap (on the GPU).
    Every row also has "shard" (its index in the sorted shard list), "row" (its place in the
    shard) and "shard_rows" (the shard's row count on its last batch's rows, else 0).

    The shard order is shuffled anew each epoch from `shuffle_seed` (None: sorted order), and each
    shard's rows in windows of `shuffle_window` (`ShuffleWindow`, seeded from `shuffle_seed` or 0);
    the `epoch_plan` actor says, when an epoch starts, which epoch it is and what it passes over
    (`read_shards`). With
    `rows_per_block` every block but the last holds exactly that many rows (a training
    micro-batch). `files` is the shard list when the caller has listed it; `resources` default to
    the whole cluster, for use outside training."""
    files = files or shards.list_shards(uri, format, endpoint_url)
    resources = resources or ingest_resources(ray.cluster_resources().get("CPU", 1.0), 0.0)
    ds = ray.data.from_items([{"place": i} for i in range(len(files))], override_num_blocks=len(files))
    ds = ds.map_batches(
        read_shards,
        fn_args=(
            tuple(files),
            image_size,
            max_length,
            ledger,
            endpoint_url,
            Subset(subset_fraction, subset_salt),
            epoch_plan,
            shuffle_seed,
            shuffle_window,
        ),
        batch_size=1,
        batch_format="numpy",
        num_cpus=resources.cpus_per_reader,
        compute=ray.data.TaskPoolStrategy(size=min(resources.max_readers, len(files))),  # more: Ray warns
    )
    # Ray would merge a task's batches up to 128 MiB blocks (a whole shard of small images): one
    # block per decoded batch reaches training sooner and bounds what a task holds.
    rows = max(DECODE_BATCH, rows_per_block or 0)
    ds.context.target_max_block_size = rows * (3 * image_size**2 + 8 * (max_length + 3))  # 3 tags
    if rows_per_block:  # slicing and joining blocks: no CPU of its own, so it never waits for one
        ds = ray_private.repartition_in_one_task(ds.repartition(target_num_rows_per_block=rows_per_block, strict=True))
    return ds


def validation_dataset(
    uri: str,
    image_size: int,
    max_length: int,
    rows: int,
    ledger=None,
    endpoint_url: str | None = None,
    format: shards.ShardFormat = "auto",
    resources: IngestResources | None = None,
) -> ray.data.MaterializedDataset:
    """The validation set: the first `rows` rows of the folder in shard order (shards sorted, each
    shard's rows in order, bad records skipped), the same for every launch, reader count and trial.
    Read with Ray Data's order preserved: unordered, `limit` kept whichever read task finished first
    (a slow first shard gave the rows of the second)."""
    ds = build_dataset(uri, image_size, max_length, ledger, endpoint_url, resources, shuffle_seed=None, format=format)
    ds = ds.limit(rows)
    ds.context.execution_options.preserve_order = True
    return ds.materialize()


class InOrderSplit(ray.train.DataConfig):
    """Ray Train's split of the training dataset, with Ray Data told to preserve order and every
    block dealt: the splitter deals blocks to the workers in turn (locality ignored under
    preserve_order), so which rows a worker gets depends on the dataset's order alone, not on which
    reader finished first. Split with `equal=False`, as Ray's equal split would cut the epoch's
    last round of blocks into pieces and drop them: how many blocks an epoch keeps would then
    depend on the number of workers (the data cursor finds the epoch's end by agreement instead,
    pipelines/data/deal.py). Other datasets (val) go to every worker whole, as Ray's own split does."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        rest = {name: ds for name, ds in datasets.items() if name != "train"}
        output = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs)
        if "train" in datasets:
            if datasets["train"].name is None:
                datasets["train"].set_name("train")
            ds = datasets["train"].copy(datasets["train"])
            ds.context.execution_options = self._resolve_execution_options("train")
            for i, split in enumerate(ds.streaming_split(world_size, equal=False)):
                output[i]["train"] = split
        return output


def in_order_split() -> InOrderSplit:
    """The split training uses (`InOrderSplit`), order preserved for train and val."""
    options = ray.train.DataConfig.default_ingest_options()
    options.preserve_order = True
    return InOrderSplit(datasets_to_split=["train"], execution_options={"train": options, "val": options})
