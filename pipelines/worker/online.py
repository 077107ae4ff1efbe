"""The worker's side of online evaluation: rank 0 hands each complete checkpoint due for evaluation
to the run's evaluation queue (pipelines/run/online_eval.py), which the driver made."""

from __future__ import annotations

from mdc.config import RunConfig
from mdc.training import checkpoint as ckpt
from pipelines.infra.actors import ask
from pipelines.worker.callbacks import Callback


class EvaluationHandOver(Callback):
    """Rank 0 hands each complete checkpoint that is due for evaluation to the run's evaluator
    without waiting; at the last checkpoint it waits until every hand-over is acknowledged, so
    none is lost with the worker when training ends."""

    def __init__(self, cfg: RunConfig, run_dir: str, evaluator):
        self.cfg, self.run_dir, self.evaluator = cfg, run_dir, evaluator
        self.handed: list = []

    def checkpoint(self, step: int, rank: int, at: str) -> None:
        if rank != 0 or at != "committed":
            return
        if self.cfg.eval.evaluations_at(step):
            self.handed.append(self.evaluator.submit.remote(step, ckpt.checkpoint_dir(self.run_dir, step)))
        if step == self.cfg.train.steps and self.handed:
            ask(self.handed, "the run's evaluation queue (the hand-over of the last checkpoints)")
            self.handed = []
