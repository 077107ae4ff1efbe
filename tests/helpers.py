"""Stand-ins shared by several test files: one helper per idea."""

import contextlib
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConstantNLL(nn.Module):
    """A captioner whose every prediction is uniform over `vocab` words: each token's NLL is
    log(vocab) and log p(C | V) = −N·log(vocab) for an N-token caption, the answer an unbiased
    loss or ELBO estimate must average to. It answers both the training call (forward) and the
    scoring calls (encode, image_keys_values, decode)."""

    def __init__(self, vocab: int, *, mask_id: int, pad_id: int, bos_id: int, eos_id: int):
        super().__init__()
        self.vocab, self.mask_id, self.pad_id, self.bos_id, self.eos_id = vocab, mask_id, pad_id, bos_id, eos_id

    def forward(self, images, tokens, t=None, causal=False, where=None, image_free=None):
        return self.decode(tokens, images, t, where)

    def encode(self, images):
        return images

    def image_keys_values(self, features):
        return features

    def decode(self, tokens, image_kv, t=None, where=None):
        """Every position's logits, or with `where` the selected ones', as the captioner's."""
        return torch.zeros(*tokens.shape, self.vocab) if where is None else torch.zeros(int(where.sum()), self.vocab)


class LocalSession:
    """Ray Train's side of the worker's `Trainer`, in this process: rank `rank` of `world_size`
    (one, unless the test made a bigger gloo group), CPU, `steps` batches of `batch` random 32-px
    images (with `same_images`, one batch repeated), cut into blocks of `block` rows and dealt as
    Ray's order-preserving split deals them: block k to rank k mod world_size, every block dealt
    (pipelines/data/deal.py)."""

    device = torch.device("cpu")

    def __init__(
        self, steps: int, batch: int = 4, same_images: bool = False, rank: int = 0, world_size: int = 1, block: int = 4
    ):
        from mdc.data.tokenizer import CaptionTokenizer

        self.rank, self.world_size, self.block, self.reports = rank, world_size, block, []
        self.notices: list = []  # what preemption_notice returns at each logged step, then None
        tokens = torch.from_numpy(CaptionTokenizer(16).encode(["a red circle", "a small blue square"] * (batch // 2)))
        rng = np.random.default_rng(0)
        images = [torch.from_numpy(rng.integers(0, 255, (batch, 3, 32, 32), dtype=np.uint8)) for _ in range(steps)]
        self.batches = [
            {
                "image": images[0 if same_images else i],
                "tokens": tokens,
                "shard": torch.full((batch,), i % 2),
                "row": torch.arange(batch),
                "shard_rows": torch.zeros(batch, dtype=torch.int64),
            }
            for i in range(steps)
        ]

    def train_batches(self, epoch):
        blocks = [
            {k: v[i : i + self.block] for k, v in b.items()}
            for b in self.batches
            for i in range(0, len(b["row"]), self.block)
        ]
        return iter(blocks[self.rank :: self.world_size])

    def held_out_batches(self):
        return []

    def report(self, metrics):
        self.reports.append(metrics)

    def preemption_notice(self):
        return self.notices.pop(0) if self.notices else None

    def broadcast(self, value):
        """Rank 0's value, by a gloo collective when the test made a bigger group."""
        if self.world_size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def local_trainer(tmp_path, steps: int, log_every: int, *overrides: str, same_images: bool = False, session=None):
    """The real worker `Trainer` on a `LocalSession` (needs a gloo group: one process unless
    `session` says otherwise), writing checkpoints and MLflow under `tmp_path`; `trainer.events`
    are its progress events."""
    from mdc.config import load_config
    from pipelines.data.ingest import IngestResources
    from pipelines.infra import tracking
    from pipelines.worker.args import WorkerArgs
    from pipelines.worker.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "model.image_size=32",
            "data.max_length=16",
            "train.batch_size=4",
            "workers.count=1",
            f"train.steps={steps}",
            f"train.log_every={log_every}",
            "checkpoint.every=100",
            "optim.warmup_steps=2",
            "workers.notice_every_s=0",  # the reclaim notice on logged steps only, unless a test says
            f"data.train_uri={tmp_path}",
            "data.val_uri=null",
            f"storage_uri={tmp_path / 'ckpt'}",
            f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            *overrides,
        ],
    )
    run_id = tracking.get_or_create_run(cfg.mlflow_uri, cfg.experiment, cfg.name, {})
    events = []
    args = WorkerArgs(
        cfg=cfg,
        run_dir=str(tmp_path / "ckpt" / cfg.name),
        mlflow_uri=cfg.mlflow_uri,
        mlflow_run_id=run_id,
        progress=SimpleNamespace(push=SimpleNamespace(remote=events.append)),
        ingest=IngestResources(1.0, 1.0, 1),
        shard_list_id="shards",
        num_shards=2,
        actors=None,
    )
    trainer = Trainer(args, session or LocalSession(steps, same_images=same_images))
    trainer.events = events
    return trainer


def same_under_meta_default_device(cases) -> None:
    """Each case (a no-argument call) gives the same tensors, on the same device, when torch's
    default device is "meta": the math makes its tensors on its inputs' device, not the default
    (which would come back on "meta", with no values)."""
    for case in cases:
        expected = torch.utils._pytree.tree_leaves(case())
        with torch.device("meta"):
            values = torch.utils._pytree.tree_leaves(case())
        assert len(values) == len(expected)
        for value, plain in zip(values, expected):
            assert value.device == plain.device and torch.equal(value, plain)


def run_overrides(tmp_path, name: str, data) -> list[str]:
    """A small run on `data` (tar shards of 32-px images) with its checkpoints and MLflow store
    under `tmp_path`, no validation set, shards in order, half a CPU for ingest."""
    return [
        f"name={name}",
        f"storage_uri={tmp_path / 'ckpt'}",
        f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"data.train_uri={data}",
        "data.val_uri=null",
        "data.max_length=16",
        "data.shuffle_buffer=0",
        "data.ingest_cpus=0.5",
    ]


LOCAL_RAY = {
    "address": "local",
    "num_cpus": 2,
    "object_store_memory": 512 * 1024**2,
    "include_dashboard": True,
}  # conftest's `ray_cluster`


@contextlib.contextmanager
def multinode_cluster(head_cpus: float, *nodes: dict):
    """pipelines.infra.local_cluster.local_cluster for a test module: the session's local Ray (conftest's
    `ray_cluster`), if a test started it, is stopped first and started again after."""
    import ray

    from pipelines.infra.local_cluster import local_cluster

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    try:
        with local_cluster(head_cpus, *nodes) as cluster:
            yield cluster
    finally:
        if had_local:
            ray.init(**LOCAL_RAY)


def in_background(call: Callable, *args, **kwargs) -> Future:
    """`call` in a driver thread, so that the main thread can add and remove nodes under it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="driver")
    future = pool.submit(call, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def wait_until(condition: Callable[[], bool], run: Future, timeout_s: float, what: str) -> None:
    """Polls `condition` until it holds; raises naming `what` when `timeout_s` passes first or the
    run ends first (with the run's own error, if it had one)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if run.done():
            error = run.exception()
            raise AssertionError(f"the run ended before {what}" + (f": {error!r}" if error else "")) from error
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.2)


def rows_by_step(directory) -> dict[int, tuple[list[tuple[int, int]], dict[int, int]]]:
    """From the directory a run's RowRecorder wrote: by step, the (shard, row) of every row trained at it (all
    ranks, every time the step was trained) and how many each rank trained."""
    from collections import defaultdict
    from pathlib import Path

    steps = defaultdict(lambda: ([], defaultdict(int)))
    for path in sorted(Path(directory).glob("rank*.txt")):
        rank = int(path.stem[len("rank") :])
        for line in path.read_text().splitlines():
            _, step, shard, row = map(int, line.split())
            steps[step][0].append((shard, row))
            steps[step][1][rank] += 1
    return {step: (rows, dict(per_rank)) for step, (rows, per_rank) in steps.items()}


def epoch_order(cfg, epoch: int = 0) -> list[tuple[int, int]]:
    """(shard, row) of epoch `epoch`'s rows in the one order training reads them in
    (pipelines/data/ingest.py), read here through Ray Data with order preserved (needs Ray)."""
    from mdc.data import shards
    from pipelines.data.ingest import EpochPlanActor, build_dataset
    from pipelines.data.position import EpochPlan
    from pipelines.run.driver import image_size

    plan = EpochPlanActor.remote()
    plan.set.remote(EpochPlan(epoch))
    files = shards.list_shards(cfg.data.train_uri, cfg.data.format, cfg.data.endpoint_url)
    ds = build_dataset(
        cfg.data.train_uri,
        image_size(cfg),
        cfg.data.max_length,
        shuffle_seed=cfg.train.seed,
        epoch_plan=plan,
        files=files,
        shuffle_window=cfg.data.shuffle_buffer,
        rows_per_block=cfg.train.batch_size,
    )
    ds.context.execution_options.preserve_order = True
    return [(int(s), int(r)) for b in ds.iter_batches(batch_format="numpy") for s, r in zip(b["shard"], b["row"])]


CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(root, per_batch: int = 10, test: int = 20, seed: int = 0):
    """CIFAR-10's python batches as the official archive holds them and torchvision reads them
    (data_batch_1..5, test_batch, batches.meta: pickled dicts of uint8 rows of 3,072 and labels),
    each image its class's colour with noise, so a probe can tell the classes apart."""
    import pickle
    from pathlib import Path

    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, (10, 3))

    def batch(n: int, name: str) -> dict:
        labels = [i % 10 for i in range(n)]
        planes = colours[labels][:, :, None] + rng.normal(0, 40, (n, 3, 1024))
        return {"batch_label": name, "labels": labels, "data": planes.clip(0, 255).astype(np.uint8).reshape(n, 3072)}

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files = {f"data_batch_{i}": batch(per_batch, f"training batch {i} of 5") for i in range(1, 6)}
    files |= {"test_batch": batch(test, "testing batch 1 of 1"), "batches.meta": {"label_names": CIFAR10_CLASSES}}
    for name, content in files.items():
        (root / name).write_bytes(pickle.dumps(content, protocol=2))
    return root


def eval_overrides(cifar10, shapes) -> list[str]:
    """The eval section the end-to-end tests of tune, compare and online evaluation share: a probe
    on CIFAR-10's python batches (torchvision's layout), the ARO-format pairs `mdc data shapes`
    wrote, captions of the shapes val split at N' = 8; small, 2 Monte Carlo draws."""
    return [
        f"eval.probes=[{{dataset: cifar10, root: {cifar10}}}]",
        f"eval.compositionality=[{{benchmark: aro, root: {shapes / 'compositionality'}}}]",
        f"eval.captions=[{{uri: {shapes / 'val'}, name: shapes, lengths: [8], limit: 4}}]",
        "eval.limit=8",
        "eval.samples=2",
    ]


# Every figure that section measures, by the key every command logs it under (mdc/evaluation/suite.py).
EVAL_KEYS = {
    *(f"eval/probe/cifar10/{f}" for f in ("accuracy", "random_init_accuracy", "gain")),
    *(f"eval/probe/cifar10/{f}" for f in ("balanced_accuracy", "random_init_balanced_accuracy", "balanced_gain")),
    *(f"eval/compositionality/aro/{s}{b}" for s in ("vg_relation", "vg_attribution", "macro") for b in ("", "/blind")),
    *(f"eval/captions/shapes/N8/{f}" for f in ("bleu4", "cider", "captions_per_s")),
}
