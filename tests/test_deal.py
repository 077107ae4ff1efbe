"""Any group size trains the global batch (pipelines/data/deal.py): the blocks Ray deals in turn
are every step's K chunks exactly once, every rank ends the epoch at the same step — the step one
rank would end it at — and 3 ranks that pad a short share train the weights 1 rank trains."""

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import LocalSession, local_trainer

from mdc.config import load_config
from mdc.training.checkpoint import full_weights
from pipelines.data.cursor import DataCursor
from pipelines.data.deal import BlockDeal
from pipelines.data.feed import BatchFeed
from pipelines.infra import tracking

pytestmark = pytest.mark.timeout(300)


def test_the_deal_of_4_chunks_over_3_ranks_by_hand():
    deal = BlockDeal(4, 3)  # step 0: blocks 0-3 → ranks 0, 1, 2, 0; step 1: blocks 4-7 → 1, 2, 0, 1
    assert [list(deal.chunks(r, 0)) for r in range(3)] == [[0, 3], [1], [2]]
    assert [list(deal.chunks(r, 1)) for r in range(3)] == [[2], [0, 3], [1]]
    assert deal.passes == 2 and deal.weight == 0.75
    assert [list(BlockDeal(2, 3).chunks(r, 0)) for r in range(3)] == [[0], [1], []]  # K < W: rank 2 only pads


def block(i: int) -> dict:
    return {"id": torch.tensor([i]), "shard": torch.tensor([0]), "shard_rows": torch.tensor([1])}


def dealt_steps(blocks: int, k: int, w: int) -> list[list[tuple[range, list[int]]]]:
    """Each of `w` ranks' cursor (a thread each, agreeing through a barrier as the gloo group
    would) over what Ray's split gives it of `blocks` blocks: block b to rank b mod W, every block
    dealt. Per step, each rank's chunks and the blocks it trains."""
    deal, flags, barrier = BlockDeal(k, w), [True] * w, threading.Barrier(w, timeout=10)

    def cursor_steps(rank: int) -> list[tuple[range, list[int]]]:
        def agree(ok: bool) -> bool:
            flags[rank] = ok
            barrier.wait()
            every = all(flags)
            barrier.wait()  # no rank writes the next step's flag before every rank read this one's
            return every

        cursor = DataCursor(
            source=None,
            feed=BatchFeed(5.0, str),
            actors=None,
            shard_list_id="x",
            num_shards=1,
            seed=0,
            rank=rank,
            deal=deal,
            device="cpu",
            agree=agree,
        )
        mine = iter([block(b) for b in range(rank, blocks, w)])
        steps = [(part.chunks, [int(b["id"]) for b in part.blocks]) for part in cursor.steps(mine)]
        assert next(mine, None) is None  # the stream was read to its end
        return steps

    with ThreadPoolExecutor(w) as pool:
        return list(pool.map(cursor_steps, range(w)))


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 7])
def test_every_step_is_its_k_blocks_once_and_every_rank_stops_where_one_rank_would(k, w):
    """Every size of epoch from k - 1 to 5k + w blocks: ⌊blocks / k⌋ steps on every rank for every W
    (with Ray's equal split, W = 3 lost the last round's blocks: 5 blocks, k = 2 gave 1 step, not 2),
    but for an epoch of fewer blocks than ranks, where a rank holds none to pad with."""
    for blocks in range(k - 1, 5 * k + w + 1):
        ranks = dealt_steps(blocks, k, w)
        steps = blocks // k if blocks >= w else 0
        assert [len(s) for s in ranks] == [steps] * w, (k, w, blocks)
        for j in range(steps):
            trained = sorted(b for s in ranks for b in s[j][1])
            assert trained == list(range(j * k, (j + 1) * k))  # the step's blocks, each once
            for s in ranks:
                chunks, ids = s[j]
                assert [j * k + c for c in chunks] == ids and len(ids) <= BlockDeal(k, w).passes


def test_an_epoch_without_a_whole_global_batch_is_an_error(gloo_process_group):
    cursor = DataCursor(
        source=lambda epoch: [block(0)],
        feed=BatchFeed(5.0, str),
        actors=None,
        shard_list_id="x",
        num_shards=1,
        seed=0,
        rank=0,
        deal=BlockDeal(2, 1),
        device="cpu",
    )
    cursor.start()
    with pytest.raises(RuntimeError, match="smaller than global_batch_size"):
        list(cursor.batches())


def train_dealt(rank: int, world: int, tmp: str, global_batch: int) -> None:
    """3 steps of `global_batch` rows in micro-batches of 2 on rank `rank` of `world`; rank 0
    writes the per-step losses and the final weights."""
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp, "store")), world), rank=rank, world_size=world)
    try:
        session = LocalSession(3, batch=global_batch, rank=rank, world_size=world, block=2)
        options = ("train.batch_size=2", f"train.global_batch_size={global_batch}")
        trainer = local_trainer(Path(tmp), 3, 1, *options, session=session)
        trainer.restore()
        trainer.run()
        weights = full_weights(trainer.model)
        if rank == 0:
            logged = {k: [r[k] for r in session.reports] for k in ("loss", "grad_norm")}
            torch.save({**logged, "weights": weights}, Path(tmp, "result.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("global_batch", [8])
def test_three_ranks_that_pad_train_as_one_rank(tmp_path, global_batch):
    """Global batch 8 (4 micro-batches: ranks hold 2, 1, 1 and run 2 passes, 2 of them padding) or
    4 (2 micro-batches: one rank holds none and pads): the per-step losses (1e-6) and gradient
    norms equal one rank's, which trains every micro-batch itself, to float summation, and so do the
    weights after 3 AdamW steps to half the learning rate (AdamW turns a float-noise gradient into
    a whole step: 8e-5 measured; padded passes weighted 0.75 instead of 0 give 4.8e-3)."""
    for world in (1, 3):
        run_dir = tmp_path / str(world)  # its own checkpoints and MLflow store
        cfg = load_config(None, [f"mlflow_uri=sqlite:///{run_dir / 'mlflow.db'}"])
        run_dir.mkdir()
        tracking.get_or_create_run(cfg.mlflow_uri, cfg.experiment, cfg.name, {})  # the ranks then find it
        mp.spawn(train_dealt, args=(world, str(run_dir), global_batch), nprocs=world, join=True)
    one, three = (torch.load(tmp_path / str(world) / "result.pt", weights_only=True) for world in (1, 3))
    assert len(one["loss"]) == 3
    torch.testing.assert_close(three["loss"], one["loss"], rtol=1e-6, atol=0)
    # the norm of FSDP's sharded gradients sums in another order: 2 ranks without padding, 1.6e-5
    torch.testing.assert_close(three["grad_norm"], one["grad_norm"], rtol=1e-4, atol=0)
    apart = max(float((three["weights"][n] - w).abs().max()) for n, w in one["weights"].items())
    print(f"largest weight difference after 3 steps: {apart:.1e}")
    assert apart < 5e-4  # lr 1e-3 / 2
