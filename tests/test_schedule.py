"""`mdc schedule`'s estimator against its closed form, on a stand-in model whose per-token loss is known."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from mdc import schedule

VOCAB, PAD, MASK = 50, 48, 49


class ConstantLoss(nn.Module):
    """Uniform logits over VOCAB: every masked token's loss is c = ln VOCAB, whatever the input."""

    mask_id, pad_id = MASK, PAD

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, images, noisy, t=None, causal=False, where=None):
        shape = (int(where.sum()),) if where is not None else noisy.shape
        return self.bias.expand(*shape, VOCAB)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny draws: with a second thread each waits on the other (20 ms a draw, not 0.6)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def captions(rows: int, length: int, real: int) -> torch.Tensor:
    tokens = torch.randint(0, 40, (rows, length), generator=torch.Generator().manual_seed(1))
    tokens[:, real:] = PAD  # pads are never masked nor counted
    return tokens


@pytest.mark.parametrize("antithetic", [False, True])
@pytest.mark.parametrize("interval", [(0.1, 1.0), (0.5, 1.0), (0.25, 0.75)])
def test_loss_estimator_matches_the_closed_form(interval, antithetic):
    """Intervals from 0.1 up: below, the estimate's fourth moment grows like 1/t_min², and a few
    thousand draws no longer pin its variance down (the sample variance is mostly an underestimate)."""
    tokens, batch, real, n = captions(64, 12, 5), 4, 5, 1500
    draws = schedule.draw_estimates(ConstantLoss(), torch.zeros(64, 1), tokens, interval, n, batch, 0, antithetic)
    c = math.log(VOCAB)
    x = draws.loss
    assert abs(x.mean() - c) < 4 * x.std(ddof=1) / math.sqrt(n)  # unbiased whatever the interval
    expected = c**2 * schedule.closed_form_relative_variance(*interval, batch * real)
    var_se = math.sqrt(np.mean((x - x.mean()) ** 4) - x.var() ** 2) / math.sqrt(n)
    assert abs(x.var(ddof=1) - expected) < 4 * var_se, (x.var(ddof=1), expected, var_se)


def test_zero_to_one_is_the_noisier_interval_with_an_interval_that_excludes_one():
    tokens, n = captions(64, 12, 4), 400
    model = ConstantLoss()
    samples = {
        iv: schedule.draw_estimates(model, torch.zeros(64, 1), tokens, iv, n, 4, seed=3).loss
        for iv in ((0.0, 1.0), (0.5, 1.0))
    }
    _, boot = schedule.bootstrap(samples, resamples=200)
    low, high = schedule.ratio_interval(boot, (0.0, 1.0), (0.5, 1.0))
    closed = schedule.closed_form_relative_variance(0, 1, 16) / schedule.closed_form_relative_variance(0.5, 1, 16)
    assert 10 < closed < 20 and 1 < low < high  # the estimate sits below `closed`: the heavy tail of t -> 0


def test_gradient_coordinates_and_the_grid():
    model = ConstantLoss()
    coords = schedule.gradient_coordinates(model, 8, seed=0)
    assert sum(len(i) for _, i in coords) == 8
    draws = schedule.draw_estimates(model, torch.zeros(8, 1), captions(8, 6, 6), (0.5, 1.0), 20, 2, coordinates=coords)
    assert draws.grad.shape == (20, 8) and np.isfinite(schedule.relative_variance(draws.grad))
    assert len(schedule.grid(0.25)) == 10 and (0.5, 1.0) in schedule.grid(0.05) and len(schedule.grid(0.05)) == 210
    with pytest.raises(ValueError, match="step 0.3"):
        schedule.grid(0.3)


def test_the_command_prints_a_table_writes_a_heat_map_and_logs_to_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from mdc.data.shapes import write_shapes_dataset
    from pipelines.cli import app

    write_shapes_dataset(str(tmp_path / "shapes"), num=40, seed=0, image_size=32)
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["--draws", "10", "--step", "0.5", "--grad-coordinates", "32", "--captions", "20", "--out", str(tmp_path)]
    overrides = [f"data.train_uri={tmp_path / 'shapes' / 'train'}", f"mlflow_uri={mlflow_uri}", "train.batch_size=4"]
    result = CliRunner().invoke(app, ["schedule", *args, *overrides])
    assert result.exit_code == 0, result.output
    assert "[0, 1] / [0.5, 1] relative variance" in result.output and "recommended: [0.5, 1]" in result.output
    assert "BD3-LM" in result.output and (tmp_path / "schedule.png").stat().st_size > 1000
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("mdc-eval").experiment_id])
    assert (
        run.data.metrics["schedule/recommended_omega_l"] == 0.5 and "schedule/loss_relvar/0.00_1.00" in run.data.metrics
    )
    bad = CliRunner().invoke(app, ["schedule", *args, *overrides[1:], f"data.train_uri={tmp_path / 'nowhere'}"])
    assert bad.exit_code == 2 and "nowhere" in bad.output
