"""A finished run judged: the one evaluation (mdc/evaluation/suite.py) of its final checkpoint on
the run's eval section, in this process, logged to its MLflow run against its last step and onto
the tags of the version it registered. What `mdc tune` (each trial), `mdc compare`, `mdc scaling`,
`mdc study` and the demo do after training, so each logs the same keys.

What the run's own online evaluation measured at its last step is taken as it is, not measured twice.
"""

from __future__ import annotations

from mdc.config import RunConfig
from mdc.evaluation import suite
from pipelines.infra import tracking
from pipelines.run import concurrency, model_registry
from pipelines.run.driver import TrainSummary, run_training


def evaluate_run(cfg: RunConfig, summary: TrainSummary, device: str = "cpu") -> suite.Evaluation:
    """The run's final checkpoint on its eval section (suite.resolve_section), one evaluation in this process at a time; its figures logged at the last step and tagged."""
    cfg = suite.resolve_section(cfg)
    online = next((r for r in summary.online if r.get("step") == cfg.train.steps and "error" not in r), {})
    measured = cfg.eval.evaluations_at(cfg.train.steps) if online else ()
    which = [kind for kind in suite.KINDS if kind not in measured]
    with concurrency.serialized():  # evaluations share the driver's cores (and torch's threads)
        subject, _ = suite.load_subject(summary.checkpoint_uri, cfg.data.endpoint_url, device)
        evaluation = suite.evaluate(subject, cfg.eval, which, cfg.data.endpoint_url)
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    tracking.log_metrics(mlflow_uri, summary.mlflow_run_id, evaluation.metrics, cfg.train.steps)
    evaluation.metrics = {**{k: v for k, v in online.items() if k.startswith(suite.PREFIX)}, **evaluation.metrics}
    model_registry.tag_figures(mlflow_uri, summary.mlflow_run_id, evaluation.metrics)
    return evaluation


def run_figures(summary: TrainSummary) -> dict[str, float]:
    """The training figures of the run's last report (suite.RUN_FIGURES) that it has."""
    return {k: summary.metrics[k] for k in suite.RUN_FIGURES if summary.metrics.get(k) is not None}


def train_and_evaluate(cfg: RunConfig, parent_run_id: str | None = None, channel=None, ray_callbacks=None) -> dict:
    """One run trained (an MLflow child of `parent_run_id`) and judged: what a comparison, a study,
    a scaling plan and a sweep keep of it."""
    summary = run_training(cfg, parent_run_id=parent_run_id, channel=channel, ray_callbacks=ray_callbacks)
    mlflow_uri = tracking.absolute_tracking_uri(cfg.mlflow_uri)
    with tracking.ended_on_error(mlflow_uri, summary.mlflow_run_id):
        try:
            evaluation = evaluate_run(cfg, summary)
        except BaseException:  # the run failed after all: the registry holds no version of it
            model_registry.withdraw(mlflow_uri, summary.mlflow_run_id)
            raise
    return {
        "run_name": cfg.name,
        "checkpoint": summary.checkpoint_uri,
        "mlflow_run_id": summary.mlflow_run_id,
        "metrics": {**run_figures(summary), **evaluation.metrics},
    }
