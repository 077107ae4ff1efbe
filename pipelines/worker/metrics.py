"""The metrics logger: per-step metrics stay on the device until a log step, where one reduction
across ranks and one read back to the host (the step's one host sync) turn every buffered step into
numbers for MLflow, the progress channel and Ray Train's report."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mdc.data.tokenizer import CaptionTokenizer
from mdc.training.step import as_plain
from pipelines.infra import progress, tracking

TOKENS = "_tokens"  # the buffered steps' caption-token counts, summed over ranks rather than averaged


class MetricsLogger:
    """Buffers each step's device metrics (`record`); `log` reduces them, writes them on rank 0
    (every step's row reaches MLflow, all at once) and returns the last step's numbers. `sinks`
    are rank 0's (an MLflow `MetricLogger` and a progress `Reporter`), None on the other ranks."""

    def __init__(self, log_every: int, steps: int, world_size: int, images_per_step: int, sinks: tuple | None):
        self.log_every, self.steps, self.world_size, self.images_per_step = (
            log_every,
            steps,
            world_size,
            images_per_step,
        )
        self.mlflow, self.reporter = sinks if sinks is not None else (None, None)
        self.device_rows: list[tuple[int, dict]] = []  # (step, {name: device tensor})
        self.host_rows: dict[int, dict] = {}  # step -> numbers known on the host (lr, epoch, val_loss)
        self.tic, self.images, self.waited = time.perf_counter(), 0, 0.0

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def record(self, step: int, metrics: dict, tokens: torch.Tensor, **host) -> None:
        """No sync: device tensors are kept, floats go with `host` (e.g. epoch) to the step's row.
        `metrics` are weighted so that their mean over ranks (`log`) is the global batch's mean;
        `tokens` are the captions this rank trained on, padding passes left out."""
        on_device = {k: v.detach() for k, v in metrics.items() if isinstance(v, torch.Tensor)}
        on_device[TOKENS] = (tokens != CaptionTokenizer.pad_id).sum()
        self.device_rows.append((step, on_device))
        self.note_host(step, **{k: v for k, v in metrics.items() if not isinstance(v, torch.Tensor)}, **host)
        self.images += self.images_per_step

    def note_host(self, step: int, **numbers) -> None:
        self.host_rows.setdefault(step, {}).update(numbers)

    def log(self, step: int, data_wait_s: float) -> dict:
        """Collective, and the one host sync: every buffered step's metrics, meaned over ranks, into
        MLflow and the progress channel; returns step `step`'s, with the throughput since the last log."""
        rows = self._reduce()
        elapsed = time.perf_counter() - self.tic
        tokens = sum(row.pop(TOKENS) for row in rows.values())
        rows[step].update(
            images_per_s=self.images / elapsed,
            tokens_per_s=tokens / elapsed,
            data_wait_fraction=(data_wait_s - self.waited) / elapsed,
        )
        self.tic, self.images, self.waited = time.perf_counter(), 0, data_wait_s
        if self.mlflow is not None:
            for s, row in rows.items():
                self.mlflow.log(row, s)
            self.mlflow.flush()
            self.reporter.step(step, rows[step], logged=True)
        return rows[step]

    def _reduce(self) -> dict[int, dict]:
        rows = {s: dict(numbers) for s, numbers in self.host_rows.items()}
        if self.device_rows:
            names = list(self.device_rows[0][1])
            stacked = torch.stack(  # every metric a scalar, whatever its shape ([1]: CLIP's logit scale)
                [torch.stack([as_plain(m[k]).float().reshape(()) for k in names]) for _, m in self.device_rows]
            )
            dist.all_reduce(stacked)
            mean = torch.where(
                torch.tensor([k == TOKENS for k in names], device=stacked.device), stacked, stacked / self.world_size
            )
            for (s, _), values in zip(self.device_rows, mean.tolist()):
                rows.setdefault(s, {}).update(zip(names, values))
        self.device_rows, self.host_rows = [], {}
        return dict(sorted(rows.items()))

    def resumed(self, step: int, uri: str, param_norm: float) -> None:
        if self.mlflow is not None:
            self.mlflow.log({"resumed_from_step": step, "resumed_param_norm": param_norm}, step)
            self.mlflow.set_tag("resumed_from", uri)

    def workers(self, step: int, now: int, before: int | None, elastic: bool) -> None:
        """The group's size from `step` on (MLflow's `workers`); an elastic group's first size, and
        a change from the checkpoint's (a group that grew or shrank), are said on the console."""
        if self.mlflow is not None:
            self.mlflow.log({"workers": now}, step)
        if before is not None and before != now:
            self.note(f"workers {before} → {now} at step {step}")
        elif before is None and elastic:
            self.note(f"{now} worker{'' if now == 1 else 's'} from step {step}")

    def note(self, text: str) -> None:
        if self.reporter is not None:
            self.reporter.note(text)


def rank0_sinks(mlflow_uri: str, run_id: str, channel, run: str, steps: int) -> tuple:
    return tracking.MetricLogger(mlflow_uri, run_id), progress.Reporter(channel, run, steps)
