"""Checkpoints in a run's storage (local and S3), on one process: a checkpoint is resumed from only
when its completion marker is there and every file matches it; pruning keeps the newest complete."""

import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from mdc.data import storage
from mdc.training import checkpoint as ckpt
from mdc.training.step import EMA

pytestmark = pytest.mark.usefixtures("gloo_process_group")  # DCP and the commit barrier are collectives


def make_state(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    ema = EMA(model, 0.9)
    return model, optimizer, scheduler, ema


def train_a_step(model, optimizer, scheduler, ema):
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    scheduler.step()
    ema.update(model)


class Known:
    """A stand-in component whose checkpoint state is what a test gives it."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def components(state, progress: dict) -> tuple[tuple, dict]:
    """(model, optimizer, ema) for DCP, and the small states: the scheduler and a stand-in."""
    model, optimizer, scheduler, ema = state
    return (model, optimizer, ema), {"scheduler": scheduler, "progress": Known(progress)}


def save(run_dir, step, state, extra=None, endpoint=None, commit=True, tmp_path=None):
    uri = ckpt.checkpoint_dir(run_dir, step)
    local = Path(tmp_path or "/tmp") / f"stage-{step}-{id(state)}"
    local.mkdir()
    parts, states = components(state, {"step": step, **(extra or {})})
    ckpt.stage_training_state(local, *parts, states, rank=0)
    written = ckpt.upload_shard(local, uri, endpoint)
    if commit:
        ckpt.commit(uri, step, written, 0, endpoint)
    return uri


def test_round_trip_restores_everything_and_every_component(tmp_path):
    state = make_state(0)
    train_a_step(*state)
    uri = save(str(tmp_path / "run"), 1, state, extra={"shard_offset": 17}, tmp_path=tmp_path)
    fresh = make_state(1)
    parts, states = components(fresh, {})
    ckpt.load_training_state(uri, *parts, states)
    assert states["progress"].state == {"step": 1, "shard_offset": 17}
    for a, b in zip(state[0].parameters(), fresh[0].parameters()):
        assert torch.equal(a, b)
    assert torch.equal(state[1].state_dict()["state"][0]["exp_avg"], fresh[1].state_dict()["state"][0]["exp_avg"])
    assert fresh[2].last_epoch == 1
    for name, value in state[3].state_dict().items():
        assert torch.equal(value, fresh[3].state_dict()[name])
    marker = json.loads(Path(uri, ckpt.MARKER).read_text())
    assert marker["step"] == 1 and marker["ranks"] == [0]
    assert set(marker["files"]) == {p.name for p in Path(uri).iterdir()} - {ckpt.MARKER}


def test_incomplete_and_damaged_checkpoints_are_skipped(tmp_path):
    run_dir = str(tmp_path / "run")
    state = make_state(0)
    good = save(run_dir, 3, state, tmp_path=tmp_path)
    flipped = save(run_dir, 6, state, tmp_path=tmp_path)
    truncated = save(run_dir, 9, state, tmp_path=tmp_path)
    unmarked = save(run_dir, 12, state, commit=False, tmp_path=tmp_path)
    shard = Path(flipped, "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shard = Path(truncated, "__0_0.distcp")
    shard.write_bytes(shard.read_bytes()[:-10])

    chosen, skipped = ckpt.newest_complete(run_dir)
    assert chosen == good
    assert skipped == [
        f"skipped {unmarked} (step 12): no {ckpt.MARKER}: a worker stopped before every shard was written",
        f"skipped {truncated} (step 9): __0_0.distcp has {len(data) - 10} bytes, {ckpt.MARKER} says {len(data)}",
        f"skipped {flipped} (step 6): __0_0.distcp does not match its CRC-32 in {ckpt.MARKER}",
    ]
    Path(good, ckpt.MARKER).write_text("{not json")
    assert ckpt.newest_complete(run_dir) == (None, skipped + [f"skipped {good} (step 3): {ckpt.MARKER} is unreadable"])
    assert ckpt.newest_complete(str(tmp_path / "no-such-run")) == (None, [])


def test_prune_keeps_newest_complete_and_drops_the_rest(tmp_path):
    run_dir = str(tmp_path / "run")
    state = make_state(0)
    for step in (2, 4, 6, 8):
        save(run_dir, step, state, tmp_path=tmp_path)
    save(run_dir, 5, state, commit=False, tmp_path=tmp_path)  # interrupted earlier attempt
    save(run_dir, 10, state, commit=False, tmp_path=tmp_path)  # from before a resume at 8's step
    ckpt.prune(run_dir, 8, keep=2)
    assert sorted(p.name for p in Path(run_dir).iterdir()) == ["checkpoint_00000006", "checkpoint_00000008"]


def test_checkpoints_in_s3(s3_server, tmp_path):
    run_dir = s3_server.make_bucket("ckpt-unit") + "/runs/a"
    endpoint = s3_server.endpoint_url
    state = make_state(0)
    train_a_step(*state)
    first = save(run_dir, 1, state, endpoint=endpoint, tmp_path=tmp_path)
    save(run_dir, 2, state, endpoint=endpoint, commit=False, tmp_path=tmp_path)
    chosen, skipped = ckpt.newest_complete(run_dir, endpoint)
    assert chosen == first == f"{run_dir}/checkpoint_00000001"
    assert len(skipped) == 1 and "checkpoint_00000002" in skipped[0]
    fresh = make_state(1)
    parts, states = components(fresh, {})
    with ckpt.local_copy(chosen, endpoint) as directory:
        ckpt.load_training_state(directory, *parts, states)
    assert states["progress"].state == {"step": 1} and ckpt.marked_step(chosen, endpoint) == 1
    assert torch.equal(state[0][0].weight, fresh[0][0].weight)
    ckpt.prune(run_dir, 1, keep=1, endpoint_url=endpoint)
    assert not any("checkpoint_00000002" in k for k in storage.list_files(run_dir, (), endpoint))


def test_a_checkpoint_finished_in_the_background_is_complete_after_wait(tmp_path):
    run_dir = str(tmp_path / "run")
    state = make_state(0)
    background = ckpt.Background()
    uri = ckpt.checkpoint_dir(run_dir, 5)
    local = tmp_path / "stage"
    local.mkdir()
    ckpt.stage_training_state(local, *components(state, {"step": 5})[0], {}, rank=0)
    released, ran_in = threading.Event(), []

    def finish():  # held until the caller has got control back: a synchronous submit would wait here in vain
        ran_in.append((threading.current_thread().name, released.wait(timeout=10)))
        ckpt.commit(uri, 5, ckpt.upload_shard(local, uri), 0, group=background.group)

    background.submit(finish)
    assert ckpt.newest_complete(run_dir) == (None, [])  # submit returned before the checkpoint was complete
    released.set()
    background.wait()
    assert ckpt.newest_complete(run_dir) == (uri, [])
    [(thread, was_released)] = ran_in
    assert thread.startswith("mdc-checkpoint") and was_released
    background.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        background.wait()


def checkpointer(run_dir: str, state, states: dict, *overrides: str):
    from mdc.config import load_config
    from pipelines.worker.checkpointer import Checkpointer

    cfg = load_config(None, ["train.steps=10", "checkpoint.every=2", *overrides])
    model, optimizer, scheduler, ema = state
    states = {"scheduler": scheduler, **states}
    return Checkpointer(cfg, run_dir, 0, model=model, optimizer=optimizer, ema=ema, states=states)


@pytest.mark.parametrize("background", ["false", "true"])
def test_the_checkpointer_restores_every_component_it_was_given(tmp_path, background):
    """Given its components once, the checkpointer saves each one's state and restores each into a
    fresh run's, and says where from; a run with no checkpoint loads nothing."""
    run_dir, option = str(tmp_path / "run"), f"checkpoint.background={background}"
    state = make_state(0)
    train_a_step(*state)
    progress, data = Known({"step": 4, "workers": 2}), Known({"epoch": 1, "consumed": [0, 3]})
    checkpointer(run_dir, state, {"train_state": progress, "data": data}, option).save(4, wait=True)

    fresh = make_state(1)
    restored = {"train_state": Known(), "data": Known()}
    assert checkpointer(run_dir, fresh, restored, option).restore() == ckpt.checkpoint_dir(run_dir, 4)
    assert {name: c.state for name, c in restored.items()} == {"train_state": progress.state, "data": data.state}
    assert fresh[2].last_epoch == state[2].last_epoch == 1
    for a, b in zip(state[0].parameters(), fresh[0].parameters()):
        assert torch.equal(a, b)

    untouched = Known({"step": 0})
    assert checkpointer(str(tmp_path / "other"), make_state(2), {"train_state": untouched}).restore() is None
    assert untouched.state == {"step": 0}


def test_a_component_the_checkpoint_has_no_state_for_is_an_error(tmp_path):
    run_dir, state = str(tmp_path / "run"), make_state(0)
    checkpointer(run_dir, state, {"train_state": Known({"step": 2})}).save(2)
    with pytest.raises(KeyError, match="no state for data"):
        checkpointer(run_dir, make_state(1), {"train_state": Known(), "data": Known()}).restore()


def test_a_checkpoint_of_the_layout_before_states_json_is_refused_by_name(tmp_path):
    """The layout before (trainer_state.json and a JSON a rank) cannot be resumed: said before any load."""
    state = make_state(0)
    uri = save(str(tmp_path / "run"), 1, state, tmp_path=tmp_path)
    Path(uri, ckpt.STATES).rename(Path(uri, "trainer_state.json"))
    parts, states = components(make_state(1), {})
    with pytest.raises(ValueError, match=rf"has no {ckpt.STATES}: an mdc from before"):
        ckpt.load_training_state(uri, *parts, states)


def test_a_relaunch_with_another_global_batch_is_refused_naming_the_field(tmp_path):
    """The checkpoint records the global batch; a relaunch whose batch differs (another workers.count
    and no train.global_batch_size) is refused in one line, the same batch or a first launch is not."""
    from mdc.config import load_config
    from pipelines.worker.checkpointer import check_global_batch, saved_global_batch

    run_dir = str(tmp_path / "run")
    two = load_config(None, ["train.batch_size=4", "workers.count=2"])
    check_global_batch(two, run_dir)  # nothing saved yet
    checkpointer(run_dir, make_state(0), {"train_state": Known({"step": 2, "global_batch": 8})}).save(2)
    assert saved_global_batch(run_dir) == (ckpt.checkpoint_dir(run_dir, 2), 8)
    check_global_batch(two, run_dir)
    check_global_batch(
        load_config(None, ["train.batch_size=4", "workers.count=1", "train.global_batch_size=8"]), run_dir
    )
    with pytest.raises(
        ValueError, match=r"global batch of 8 rows, this launch would train 4 .*train\.global_batch_size: 8"
    ) as err:
        check_global_batch(load_config(None, ["train.batch_size=4", "workers.count=1"]), run_dir)
    assert "\n" not in str(err.value)
