"""A resumed worker crops its steps as the uninterrupted run did: the real `Trainer` in one
process, the same images at every step, so a step's input differs between runs only if its crop
does. Ray's own resume of a whole run (data position, skip counts) is tests/test_pipeline.py's."""

import pytest
import torch
from helpers import local_trainer

from mdc.data.images import normalize
from mdc.training import checkpoint as ckpt
from pipelines.worker import trainer as trainer_module

pytestmark = pytest.mark.timeout(300)
STEPS, SAVED = 6, 3


def inputs_by_step(trainer, monkeypatch) -> dict[int, torch.Tensor]:
    """Run the trainer (restore, train) and keep the images each optimiser step was given."""
    seen, device_step = {}, trainer_module.device_step

    def recording(model, optimizer, scheduler, images, *args, **kwargs):
        seen[trainer.step] = images.clone()
        return device_step(model, optimizer, scheduler, images, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "device_step", recording)
    trainer.restore()
    trainer.run()
    return seen


@pytest.mark.parametrize("kind", ["crop", "crop_flip"])
def test_a_resumed_worker_crops_each_step_as_the_first_run_did(gloo_process_group, tmp_path, monkeypatch, kind):
    options = (f"data.augment={kind}", f"checkpoint.every={SAVED}")
    first = local_trainer(tmp_path, STEPS, 3, *options, same_images=True)
    uncropped = normalize(first.session.batches[0]["image"])
    before = inputs_by_step(first, monkeypatch)
    assert sorted(before) == list(range(1, STEPS + 1))
    assert not any(torch.equal(before[s], uncropped) for s in before)  # every step cropped
    assert not torch.equal(before[4], before[5])  # each step its own crops

    ckpt.remove(ckpt.checkpoint_dir(first.checkpointer.run_dir, STEPS))  # the run stopped after step 3's save
    resumed = local_trainer(tmp_path, STEPS, 3, *options, same_images=True)
    after = inputs_by_step(resumed, monkeypatch)
    assert sorted(after) == [4, 5, 6]
    for step in after:
        assert torch.equal(after[step], before[step]), step


def test_without_augmentation_every_step_sees_the_batch_itself(gloo_process_group, tmp_path, monkeypatch):
    trainer = local_trainer(tmp_path, 3, 3, same_images=True)
    seen = inputs_by_step(trainer, monkeypatch)
    assert all(torch.equal(images, normalize(trainer.session.batches[0]["image"])) for images in seen.values())


def test_a_chunk_gets_the_same_noise_and_crops_on_any_rank_and_split(gloo_process_group, tmp_path):
    """A global batch of two micro-batch chunks: trained as 1 rank × 2 micro-batches, or as rank 0
    and rank 1 of a group of 2 with one micro-batch each, every chunk is cropped alike and draws the
    same noise, so the step's loss is the mean of the two ranks' losses (to float rounding). Keyed by
    rank instead, rank 1's chunk would be cropped and masked as rank 0's."""
    from mdc.registry import compute_loss
    from mdc.training.step import device_step
    from pipelines.data.cursor import StepBlocks
    from pipelines.data.deal import BlockDeal
    from pipelines.data.seeds import noise_generator

    trainer = local_trainer(tmp_path, 1, 1, "data.augment=crop", "train.global_batch_size=4", "train.batch_size=2")
    batch = trainer.session.batches[0]
    blocks = [{k: v[2 * c : 2 * c + 2] for k, v in batch.items()} for c in (0, 1)]
    alone, pair = BlockDeal(2, 1), BlockDeal(2, 2)
    images, tokens = trainer._inputs(StepBlocks(blocks, alone.chunks(0, 0), blocks[0]), 7)
    trainer.deal = pair
    by_rank = [trainer._inputs(StepBlocks([blocks[r]], pair.chunks(r, 0), blocks[r]), 7) for r in (0, 1)]
    assert torch.equal(images, torch.cat([by_rank[0][0], by_rank[1][0]]))
    as_rank_0 = trainer._inputs(StepBlocks([blocks[1]], pair.chunks(0, 0), blocks[1]), 7)[0]
    assert not torch.equal(by_rank[1][0], as_rank_0)

    model, objective = trainer.model, trainer.cfg.objective
    with torch.no_grad():
        rank_losses = [
            compute_loss(model, imgs, toks, objective, noise_generator(0, 7, chunk, "cpu"))[0]
            for r, (imgs, toks) in enumerate(by_rank)
            for chunk in pair.chunks(r, 0)
        ]
    noise = [noise_generator(0, 7, chunk, "cpu") for chunk in alone.chunks(0, 0)]
    loss = device_step(
        model, trainer.optimizer, trainer.scheduler, images, tokens, objective, 1.0, generator=noise, micro_batches=2
    )
    torch.testing.assert_close(loss["loss"], torch.stack(rank_losses).mean(), rtol=1e-6, atol=0)


def test_a_reclaim_notice_saves_a_checkpoint_at_the_next_logged_step_once(gloo_process_group, tmp_path):
    """checkpoint.every 100, logged every 2 steps: the notice read at step 4 saves checkpoint 4 (and
    only it, though the notice is read again at 6 and 8); a second node's notice at 8 saves 8. The
    run resumed from 4 trains steps 5 on, as from any checkpoint."""
    from types import SimpleNamespace

    trainer = local_trainer(tmp_path, 10, 2)
    first = SimpleNamespace(deadline_ms=None, preempted_node_ids=["node-a"], preempted_ranks=[0])
    second = SimpleNamespace(deadline_ms=None, preempted_node_ids=["node-a", "node-b"], preempted_ranks=[0])
    trainer.session.notices = [None, first, first, second]  # read at steps 2, 4, 6, 8; none at 10
    trainer.restore()
    trainer.run()
    saved = sorted(step for step, _ in ckpt._checkpoints(trainer.checkpointer.run_dir, None))
    assert saved == [4, 8, 10]  # 10: the last step
    assert all(ckpt.problem(ckpt.checkpoint_dir(trainer.checkpointer.run_dir, s)) is None for s in saved)
    notes = [e for e in trainer.events if "reclaim notice" in str(e)]
    assert len(notes) == 2 and "checkpoint at step 4" in str(notes[0]), notes

    for step in (10, 8):
        ckpt.remove(ckpt.checkpoint_dir(trainer.checkpointer.run_dir, step))
    resumed = local_trainer(tmp_path, 10, 2)
    resumed.restore()
    assert resumed.step == 4


def test_the_final_metrics_are_the_last_report_also_for_a_relaunch_of_a_finished_run(gloo_process_group, tmp_path):
    """What `train_loop` hands the driver (`Result.return_value`): the last report; a run launched
    again once finished restores its final checkpoint, trains and reports nothing, and hands back
    the same metrics, from the trainer's checkpoint state."""
    first = local_trainer(tmp_path, 4, 2, "checkpoint.every=2")
    first.restore()
    first.run()
    assert first.reported == first.session.reports[-1] and first.reported["step"] == 4

    again = local_trainer(tmp_path, 4, 2, "checkpoint.every=2")
    again.restore()
    again.run()
    assert again.step == 4 and again.session.reports == []
    assert again.reported == first.reported


def test_the_notice_schedule_reads_every_interval_of_rank_0s_clock():
    """Steps of 1 s, then of 0.25 s: reads at step 1 (start-up), then every 5 s of steps."""
    from pipelines.worker.notice import NoticeSchedule

    now = [0.0]
    schedule = NoticeSchedule(5.0, clock=lambda: now[0])
    reads = []
    for step in range(1, 40):
        now[0] += 1.0 if step <= 11 else 0.25
        if schedule.due(step):
            reads.append(step)
            schedule.agree(step, schedule.gap(step))
    assert reads == [1, 6, 11, 16, 36]  # 16: the gap measured at 11 was of 1-s steps; then 20 steps of 0.25 s
    assert not NoticeSchedule(0.0).due(1)  # 0: logged steps only
    resumed = NoticeSchedule(5.0, clock=lambda: now[0])
    resumed.start(1000)
    assert not resumed.due(1000) and resumed.due(1001)
    now[0] += 1.0
    assert resumed.gap(1001) == 5  # one step of 1 s since the resume, not 1001


def test_a_reclaim_notice_is_read_on_a_wall_clock_interval_whatever_log_every_is(gloo_process_group, tmp_path):
    """Logged only at the last step; steps of 1 s on the schedule's clock, notices every 5 s: read at
    steps 1 and 6 (and 10, logged), the notice at 6 saves checkpoint 6 at once."""
    from types import SimpleNamespace

    from pipelines.worker.notice import NoticeSchedule

    trainer = local_trainer(tmp_path, 10, 100, "workers.notice_every_s=5")
    trainer.notices = NoticeSchedule(5.0, clock=lambda: float(trainer.step))
    node = SimpleNamespace(deadline_ms=None, preempted_node_ids=["node-a"], preempted_ranks=[0])
    trainer.session.notices = [None, node, node]  # read at steps 1, 6 and 10
    trainer.restore()
    trainer.run()
    assert not trainer.session.notices
    saved = sorted(step for step, _ in ckpt._checkpoints(trainer.checkpointer.run_dir, None))
    assert saved == [6, 10] and [r["step"] for r in trainer.session.reports] == [6, 10]
    notes = [e for e in trainer.events if "reclaim notice" in str(e)]
    assert len(notes) == 1 and "checkpoint at step 6" in str(notes[0]), notes
