"""What the encoder has learned, during training: the run's eval section (mdc/evaluation/suite.py:
probes, compositionality, captions) on the model at `eval.probe_every`, `eval.compositionality_every`
and `eval.captions_every` steps, logged against the step under the keys every command uses.

The training workers never wait for it. Those steps write a checkpoint with the exported weights
(`Checkpointer`); once it is complete, rank 0 hands its location to the run's `EvaluationQueueActor`
(`EvaluationHandOver`, a worker callback) and trains on. The actor reads the weights into
Ray's object store at once — so a checkpoint pruned later loses nothing — and starts one Ray task
per checkpoint in the run's evaluation bundle: the `eval.cpus` / `eval.gpus` that `reserve` sets
aside before the worker group is placed, so an evaluation never waits for training (nor for another
run at once) to give them back, and runs on its GPU when it has one. The random-init probe, the same
at every step, is measured once (the first task) and handed to the others. At the last checkpoint
rank 0 waits until the evaluator has acknowledged every hand-over; the driver then waits for the
last evaluations (`eval.timeout_s`) and says what they found. Why this queue and not Ray Train's own
validation of reported checkpoints: docs/design.md §7, "Online evaluation".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mdc.config import RunConfig
from mdc.data.tokenizer import CaptionTokenizer
from mdc.evaluation import suite
from mdc.registry import build_model
from mdc.training import checkpoint as ckpt
from pipelines.infra import tracking

RESERVE_TIMEOUT_S = 300.0


def bundle(cfg: RunConfig) -> dict[str, float]:
    """What one online evaluation holds while it runs (none without online evaluation)."""
    ev = cfg.eval
    return {k: v for k, v in (("CPU", ev.cpus), ("GPU", ev.gpus)) if v > 0} if ev.enabled else {}


@contextlib.contextmanager
def reserved(cfg: RunConfig) -> Iterator[PlacementGroup | None]:
    """The run's evaluation bundle, set aside while the run lasts: made before the worker group
    asks for its resources, so neither training nor another run at once can take them."""
    wanted = bundle(cfg)
    if not wanted:
        yield None
        return
    group = placement_group([wanted], strategy="PACK", name=f"{cfg.name}-online-eval")
    try:
        try:
            ray.get(group.ready(), timeout=RESERVE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources()
            raise TimeoutError(
                f"online evaluation: {wanted} (eval.cpus, eval.gpus) were not free on one node within "
                f"{RESERVE_TIMEOUT_S:g} s ({free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs free in the "
                "cluster); lower them, or leave room beside the training workers"
            ) from None
        yield group
    finally:
        remove_placement_group(group)


def evaluation_device(gpus: float) -> torch.device:
    """The GPU Ray gave an evaluation that asked for one (eval.gpus), else the CPU."""
    if gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"eval.gpus = {gpus:g}, but the evaluation task sees no CUDA device")
    return torch.device("cuda")


def subject_of(cfg: RunConfig, weights: dict | None, threads: int, device: torch.device | None = None) -> suite.Subject:
    """A checkpoint's weights (None: the architecture at random init alone) as the evaluation's
    subject, on `device`, in a task of `threads` threads."""
    torch.set_num_threads(max(1, threads))
    model = build_model(cfg, CaptionTokenizer)
    if weights is not None:
        model.load_state_dict(weights)
    device = device or torch.device("cpu")
    return suite.of_captioner(model.to(device).eval(), cfg, device)


def evaluate_weights(
    cfg: RunConfig,
    weights: dict,
    which: tuple[str, ...],
    threads: int,
    device: torch.device | None = None,
    baseline: dict[str, float] | None = None,
) -> dict[str, float]:
    """The figures of one checkpoint's weights on the run's eval section (the kinds in `which`)."""
    subject = subject_of(cfg, weights, threads, device)
    return suite.evaluate(subject, cfg.eval, which, cfg.data.endpoint_url, baseline).metrics


@ray.remote(max_retries=1)
def _baseline_task(cfg: RunConfig) -> dict[str, float]:
    """The probes of the run's architecture at random init: the same at every step, measured once."""
    subject = subject_of(cfg, None, int(cfg.eval.cpus) or 1, evaluation_device(cfg.eval.gpus))
    return suite.random_init_figures(subject, cfg.eval, cfg.data.endpoint_url)


@ray.remote(max_retries=1)
def _evaluate_task(
    cfg: RunConfig, weights: dict, step: int, which: tuple[str, ...], mlflow_uri: str, run_id: str, baseline: dict
):
    tic = time.perf_counter()
    device = evaluation_device(cfg.eval.gpus)
    metrics = evaluate_weights(cfg, weights, which, int(cfg.eval.cpus) or 1, device, baseline)
    tracking.log_metrics(mlflow_uri, run_id, metrics, step)
    return {"step": step, "seconds": time.perf_counter() - tic, **metrics}


class EvaluationQueue:
    """The run's pending and finished online evaluations (one Ray actor per run, made by the driver)."""

    def __init__(self, cfg: RunConfig, mlflow_uri: str, run_id: str, group: PlacementGroup | None = None):
        self.cfg, self.mlflow_uri, self.run_id, self.group = cfg, mlflow_uri, run_id, group
        self.pending: dict[int, ray.ObjectRef] = {}
        self.baseline: ray.ObjectRef | None = None  # the random-init probes, measured by the first task

    def _options(self) -> dict:
        """A task in the run's evaluation bundle."""
        ev = self.cfg.eval
        strategy = self.group and PlacementGroupSchedulingStrategy(self.group, 0)
        return {"num_cpus": ev.cpus, "num_gpus": ev.gpus, "scheduling_strategy": strategy}

    def submit(self, step: int, checkpoint_uri: str) -> None:
        """Read the checkpoint's exported weights now and evaluate them in a task of their own, in
        the run's evaluation bundle (`reserve`). A step evaluated before (a worker group that
        retried past it) is not evaluated again."""
        if step in self.pending:
            return
        weights = ckpt.read_weights(checkpoint_uri, self.cfg.data.endpoint_url)
        which = self.cfg.eval.evaluations_at(step)
        if self.baseline is None and "probe" in which:
            self.baseline = _baseline_task.options(**self._options()).remote(self.cfg)
        baseline = self.baseline if "probe" in which else {}  # Ray hands the task its value
        self.pending[step] = _evaluate_task.options(**self._options()).remote(
            self.cfg, ray.put(weights), step, which, self.mlflow_uri, self.run_id, baseline
        )

    def results(self, timeout_s: float) -> list[dict]:
        """Every evaluation's figures by step; one that failed or did not finish in `timeout_s`
        is an entry with its `error`."""
        deadline, out = time.monotonic() + timeout_s, []
        for step, ref in sorted(self.pending.items()):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                out.append({"step": step, "error": f"not finished within eval.timeout_s = {timeout_s:g} s"})
            except ray.exceptions.RayError as err:
                out.append({"step": step, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"})
        return out


EvaluationQueueActor = ray.remote(num_cpus=0)(EvaluationQueue)


def summary_line(results: list[dict]) -> str:
    """One line for the console: each step's headline figures (suite.headline), or its error."""

    def one(r: dict) -> str:
        if "error" in r:
            return f"step {r['step']}: {r['error']}"
        return f"step {r['step']}: " + ", ".join(f"{k} {v:.3f}" for k, v in suite.headline(r).items())

    return "online evaluation — " + "; ".join(one(r) for r in results)
