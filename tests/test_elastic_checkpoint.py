"""An elastic group's checkpoint changes hands between group sizes: two gloo processes train the
real worker `Trainer` (FSDP2 shards over 2 ranks, 1 micro-batch each of the global batch of 8),
and one process resumes their checkpoint (DCP reshards it onto 1 rank, 2 micro-batches of 4) with
the same weights and optimiser state, says the group shrank, and trains on. No Ray: the
multi-node grow/shrink is tests/test_elastic.py."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import LocalSession, local_trainer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from mdc.config import load_config
from mdc.training import checkpoint as ckpt
from pipelines.infra import tracking

pytestmark = pytest.mark.timeout(300)
ELASTIC = ("workers.count=[1,2]", "train.global_batch_size=8", "checkpoint.every=3")


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Collective: the full weights and the full Adam moments, by name (on rank 0; {} elsewhere)."""
    optim = get_optimizer_state_dict(
        trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    moments = {
        f"{name}.{key}": value.clone()
        for name, state in optim.get("state", {}).items()
        for key, value in state.items()
        if torch.is_tensor(value) and value.dim() > 0
    }
    return {**ckpt.full_weights(trainer.model), **moments}


def train_on_two_ranks(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp, "store")), 2), rank=rank, world_size=2)
    try:
        session = LocalSession(3, batch=4, rank=rank, world_size=2)
        trainer = local_trainer(Path(tmp), 6, 3, *ELASTIC, session=session)
        assert trainer.deal.passes == 1
        trainer.restore()
        trainer.run()
        state = full_state(trainer)
        if rank == 0:
            torch.save(state, Path(tmp, "state.pt"))
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_two_ranks_resumes_on_one_with_the_same_state(gloo_process_group, tmp_path):
    cfg, mlflow_uri = load_config(None), f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.get_or_create_run(mlflow_uri, cfg.experiment, cfg.name, {})  # the ranks then find it
    mp.spawn(train_on_two_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    two_ranks = torch.load(tmp_path / "state.pt", weights_only=True)

    session = LocalSession(2, batch=8)  # one rank: the whole global batch of 8, as 2 micro-batches of 4
    resumed = local_trainer(tmp_path, 8, 1, *ELASTIC, session=session)
    assert resumed.deal.passes == 2
    resumed.restore()
    assert resumed.step == 6
    one_rank = full_state(resumed)
    assert one_rank.keys() == two_ranks.keys() and any(".exp_avg" in k for k in one_rank)
    for name, value in two_ranks.items():
        assert torch.equal(one_rank[name], value), name
    assert [e["text"] for e in resumed.events if "worker" in e.get("text", "")] == ["workers 2 → 1 at step 6"]

    resumed.run()
    assert resumed.step == 8 and [r["step"] for r in session.reports] == [7, 8]
    history = tracking.metric_history(mlflow_uri, run_id, ["workers"])
    assert history["workers"] == [(0, 2.0), (6, 1.0)]
