"""A resumed worker crops its steps as the uninterrupted run did: the real `Trainer` in one
process, the same images at every step, so a step's input differs between runs only if its crop
does. Ray's own resume of a whole run (data position, skip counts) is tests/test_pipeline.py's."""

import pytest
import torch
from helpers import local_trainer

from mdc.data.images import normalize
from mdc.train import checkpoint as ckpt
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
    trainer.train()
    return seen


@pytest.mark.parametrize("kind", ["crop", "crop_flip"])
def test_a_resumed_worker_crops_each_step_as_the_first_run_did(gloo_process_group, tmp_path, monkeypatch, kind):
    options = (f"data.augment={kind}", f"train.checkpoint_every={SAVED}")
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
