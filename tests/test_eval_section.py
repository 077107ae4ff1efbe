"""The run config's eval section and the one evaluation every command calls (mdc/evaluation/suite.py):
the section checked before any cluster work, the default that probes what `mdc data` wrote, every
figure under its one key and equal to its measurement made by hand, `mdc eval all` on a checkpoint
equal to the same function, the experiment skeleton's failed runs, and `mdc eval captions`' lengths,
steps, schedules and file names. The end-to-end runs: tests/test_tune.py, test_compare.py,
test_online_eval.py."""

import functools
import json
from pathlib import Path

import pytest
import torch
from helpers import EVAL_KEYS, eval_overrides
from typer.testing import CliRunner

from mdc.config import ConfigError, RunConfig, derive, dump_config, load_config, load_exported_config
from mdc.evaluation import compositionality, probe, readers, suite
from mdc.sampling import SCHEDULES
from mdc.training.checkpoint import export_weights
from pipelines.cli import app

DOCS = Path(__file__).resolve().parent.parent / "docs"


def tiny(*overrides: str) -> RunConfig:
    return load_config(None, ["data.max_length=16", *overrides])


def test_the_default_section_probes_what_mdc_data_wrote_and_other_data_names_eval_probes(shapes_dir, img2dataset_dir):
    cfg = suite.resolve_section(tiny(f"data.train_uri={shapes_dir / 'train'}", "data.val_uri=null", "train.seed=3"))
    ev = cfg.eval
    assert [(p.dataset, p.root, p.key) for p in ev.probes] == [("shapes", str(shapes_dir), "shapes")]
    assert [(c.benchmark, c.root, c.key) for c in ev.compositionality] == [("shapes", str(shapes_dir), "shapes")]
    assert [(c.uri, c.name, c.lengths) for c in ev.captions] == [(str(shapes_dir / "val"), "shapes", [10])]
    assert ev.seed == 3 and suite.resolve_section(cfg) == cfg  # concrete: resolving again changes nothing

    unlabelled = suite.resolve_section(tiny(f"data.train_uri={img2dataset_dir}", "data.val_uri=null"))
    assert unlabelled.eval.probes == [] and unlabelled.eval.compositionality == [] and unlabelled.eval.captions == []
    with pytest.raises(ConfigError) as err:
        suite.require(unlabelled, "probes", "mdc tune")
    assert "\n" not in str(err.value) and "mdc tune needs eval.probes" in str(err.value)
    assert str(img2dataset_dir) in str(err.value) and "eval.probes=[{dataset: cifar10" in str(err.value)
    with pytest.raises(ConfigError, match="eval.probe_every needs eval.probes"):
        suite.resolve_section(tiny(f"data.train_uri={img2dataset_dir}", "eval.probe_every=5"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["eval.data_uri=runs/shapes"],
            "eval.data_uri is gone; name the held-out data in the eval section: eval.probes",
        ),
        (["eval.probes=[{dataset: cifar11, root: /x}]"], "eval.probes.0: dataset 'cifar11' is not one of cifar10"),
        (["eval.probes=[{root: /x}]"], "eval.probes.0.dataset: Field required"),
        (["eval.probes=[{dataset: cifar10, root: /x, nme: a}]"], "eval.probes.0.nme: unknown field"),
        (["eval.compositionality=[{benchmark: aro}]"], "eval.compositionality.0: root is required for aro"),
        (
            ["eval.compositionality=[{benchmark: aro, root: /a, subsets: [swap_att]}]"],
            "subsets ['swap_att'] are not aro",
        ),
        (["eval.probes=[{dataset: cifar10, root: /a}, {dataset: cifar10, root: /b}]"], "two entries named 'cifar10'"),
    ],
)
def test_a_bad_eval_section_is_one_error_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny(*overrides)
    assert message in str(err.value)
    if overrides[0].startswith("eval.data_uri"):
        assert "\n" not in str(err.value)


def test_what_only_the_data_or_the_disk_can_tell_is_found_before_any_cluster_work(shapes_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.captions.0.lengths: N' \[20\] above data.max_length 16"):
        suite.resolve_section(tiny(f"data.train_uri={shapes_dir / 'train'}", "eval.captions=[{lengths: [20]}]"))
    for overrides, message in (
        (["eval.probes=[{dataset: cifar10, root: /nowhere}]"], "eval.probes.0.root: /nowhere does not exist"),
        ([f"eval.probes=[{{dataset: shapes, root: {tmp_path}}}]"], "eval.probes.0.root: "),
        (["eval.compositionality=[{benchmark: aro, root: /nowhere}]"], "eval.compositionality.0.root: /nowhere is not"),
        ([f"eval.captions=[{{uri: {tmp_path / 'gone'}}}]"], "eval.captions.0.uri: "),
    ):
        with pytest.raises(ConfigError, match=message):
            suite.check_section(tiny(*overrides).eval)
    old = tmp_path / "config.yaml"  # a checkpoint exported before the section named its sets
    old.write_text(f"eval:\n  data_uri: {shapes_dir}\n  probe_every: 5\n")
    ev = load_exported_config(old).eval
    assert [(p.dataset, p.root) for p in ev.probes] == [("shapes", str(shapes_dir))]
    assert [(c.benchmark, c.root) for c in ev.compositionality] == [("shapes", str(shapes_dir))]


def test_config_show_eval_documents_each_entry_field():
    result = CliRunner().invoke(app, ["config", "show", "eval"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for field in ("probes[].dataset", "probes[].root", "compositionality[].benchmark", "captions[].lengths"):
        assert any(line.strip().startswith(f"eval.{field}:") for line in lines), field
    assert "eval.probes[].dataset: str (required)" in result.output


@pytest.fixture(scope="module")
def judged(shapes_dir, cifar10_dir, tmp_path_factory):
    """A tiny captioner at random init, exported as training exports a checkpoint, with the shared
    eval section, and what the one evaluation found."""
    cfg = suite.resolve_section(
        tiny(f"data.train_uri={shapes_dir / 'train'}", *eval_overrides(cifar10_dir, shapes_dir), "train.seed=1")
    )
    model = probe.random_init(cfg, seed=7)
    directory = tmp_path_factory.mktemp("judged") / "checkpoint_00000012"
    export_weights(directory, model.state_dict(), dump_config(cfg))
    (directory / "complete.json").write_text(json.dumps({"step": 12, "ranks": [0], "files": {}}))
    evaluation = suite.evaluate(suite.of_captioner(model, cfg), cfg.eval)
    return cfg, model, directory, evaluation


def test_every_figure_under_its_key_equal_to_its_measurement_by_hand(judged, cifar10_dir, shapes_dir):
    cfg, model, _, evaluation = judged
    metrics = evaluation.metrics
    assert set(metrics) == EVAL_KEYS
    train, test = (readers.read_split("cifar10", str(cifar10_dir), s) for s in ("train", "test"))
    trained = probe.linear_probe(train, test, lambda split: probe.extract_features(model, split.sources))
    fresh = probe.random_init(cfg, seed=1)  # the baseline is the architecture at the eval seed (train.seed)
    baseline = probe.linear_probe(train, test, lambda split: probe.extract_features(fresh, split.sources))
    assert metrics["eval/probe/cifar10/accuracy"] == trained["accuracy"]
    assert metrics["eval/probe/cifar10/random_init_accuracy"] == baseline["accuracy"]
    assert metrics["eval/probe/cifar10/gain"] == trained["accuracy"] - baseline["accuracy"]
    assert metrics["eval/probe/cifar10/balanced_accuracy"] == trained["balanced_accuracy"]
    assert metrics["eval/probe/cifar10/random_init_balanced_accuracy"] == baseline["balanced_accuracy"]
    assert metrics["eval/probe/cifar10/balanced_gain"] == trained["balanced_accuracy"] - baseline["balanced_accuracy"]
    items = compositionality.read_benchmark("aro", shapes_dir / "compositionality")
    _, score = compositionality.get_scorer("auto", "mdc")
    alone = compositionality.evaluate_compositionality(model, items, score, samples=2, seed=1, limit=8)
    assert metrics["eval/compositionality/aro/vg_relation"] == alone["accuracy"]["vg_relation"]
    assert metrics["eval/compositionality/aro/macro/blind"] == alone["macro_blind_accuracy"]
    assert 0.0 <= metrics["eval/captions/shapes/N8/cider"] and metrics["eval/captions/shapes/N8/captions_per_s"] > 0


def test_mdc_eval_all_on_the_checkpoint_is_the_same_function(judged, tmp_path):
    _, _, directory, evaluation = judged
    out = tmp_path / "all.json"
    result = CliRunner().invoke(
        app, ["eval", "all", "--checkpoint", str(directory), "--out", str(out), "--mlflow-uri", ""]
    )
    assert result.exit_code == 0, result.output
    logged = json.loads(out.read_text())["metrics"]
    assert {k: v for k, v in logged.items() if not k.endswith("captions_per_s")} == {
        k: v
        for k, v in evaluation.metrics.items()
        if not k.endswith("captions_per_s")  # a clock, not a score
    }
    assert "eval/probe/cifar10/accuracy: " in result.output


def test_subjects_built_alike_share_one_random_init_probe(monkeypatch, cifar10_dir):
    monkeypatch.setattr(suite, "_RANDOM_INIT", {})
    probed = []
    monkeypatch.setattr(
        suite.probe,
        "linear_probe",
        lambda train, test, features: probed.append(1) or {"accuracy": 0.5, "balanced_accuracy": 0.25},
    )
    spec = tiny(f"eval.probes=[{{dataset: cifar10, root: {cifar10_dir}}}]").eval.probes[0]
    split = readers.Split("x/train", [], torch.zeros(0), ["a"])
    for overrides, seed in (
        (["objective.name=mdc"], 0),
        (["objective.name=cmlm"], 0),
        (["objective.name=bert", "objective.mask_ratio=0.75"], 0),
        (["objective.name=mdc"], 1),
        (["objective.name=clip"], 0),
        (["objective.name=mdc"], 0),
    ):
        subject = suite.of_captioner(None, tiny(*overrides))
        assert suite._random_init_probe(subject, spec, split, split, seed) == {
            "accuracy": 0.5,
            "balanced_accuracy": 0.25,
        }
    other = spec.model_copy(update={"root": "/elsewhere"})
    suite._random_init_probe(suite.of_captioner(None, tiny()), other, split, split, 0)
    assert len(probed) == 4  # the masked three at seed 0, seed 1, CLIP, other data


def test_a_failed_run_of_an_experiment_ends_its_parent_failed_and_is_tried_again(monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.commands import experiment

    base = tiny(f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    configs = {key: derive(base, {"name": f"x-{key}"}) for key in ("good", "bad")}
    trained = []

    def train_and_evaluate(cfg, parent, channel):
        trained.append(cfg.name)
        if cfg.name == "x-bad" and len(trained) < 3:
            raise RuntimeError("the bad run broke")
        return {"run_name": cfg.name, "metrics": {"loss": 1.0}}

    monkeypatch.setattr(experiment, "train_and_evaluate", train_and_evaluate)
    monkeypatch.setattr(experiment.concurrency, "plan_concurrency", lambda cfgs, n: (1, cfgs))
    result = functools.partial(lambda cfg: str(tmp_path / "runs" / cfg.name / "result.json"))
    client = MlflowClient(base.mlflow_uri)
    for launch, status in ((1, "FAILED"), (2, "FINISHED")):
        with experiment.parent_run(base, "plan", {}) as parent:
            results = experiment.run_runs(parent, configs, result, None)
        assert client.get_run(parent.run_id).info.status == status
        if launch == 1:
            assert list(results) == ["good"] and [f.run_name for f in parent.failures] == ["x-bad"]
            assert "the bad run broke" in Path(parent.failures[0].error_uri).read_text()
    assert trained == ["x-good", "x-bad", "x-bad"]  # the relaunch reran the failed run only
    assert list(results) == ["good", "bad"]


def test_eval_captions_writes_what_fits_the_model_names_its_files_by_the_run(
    untrained_checkpoint, shapes_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    common = ["eval", "captions", "--checkpoint", str(untrained_checkpoint), "--data", str(shapes_dir / "val")]
    result = CliRunner().invoke(app, [*common, "--limit", "2", "--mlflow-uri", ""])
    assert result.exit_code == 0, result.output
    name = f"captions-{shapes_dir.name}-checkpoint_00000010"  # the run: the caption set (its folder), the checkpoint
    written = json.loads((tmp_path / f"{name}.json").read_text())
    assert list(written["lengths"]) == ["10", "15"] and written["skipped_lengths"] == []  # 20 > max_length 16
    assert (tmp_path / f"{name}.html").is_file() and "skipped" not in result.output

    written = {}
    for steps in ("6", "4"):  # ancestral sampling draws at every pass: 6 passes would draw otherwise than 4
        out = tmp_path / f"steps{steps}.json"
        args = ["--lengths", "4", "--sampler", "ancestral", "--steps", steps, "--limit", "4", "--out", str(out)]
        result = CliRunner().invoke(app, [*common, *args, "--mlflow-uri", ""])
        assert result.exit_code == 0, result.output
        written[steps] = [c["generated"] for c in json.loads(out.read_text())["captions"]]
        said = "--steps 6 is more passes than N' = 4 has tokens" in " ".join(result.output.split())
        assert said == (steps == "6")
    assert written["6"] == written["4"]  # clamped: N' = 4 in 4 passes
    result = CliRunner().invoke(app, [*common, "--schedule", "slow", "--mlflow-uri", ""])
    assert result.exit_code == 2 and "schedule 'slow': expected fixed | linear | cosine" in result.output


def test_one_list_of_schedule_names_in_code_help_and_docs():
    help_text = " ".join(CliRunner().invoke(app, ["eval", "captions", "--help"]).output.split())
    assert " | ".join(SCHEDULES) in help_text
    docs = (DOCS / "evaluation.md").read_text()
    assert f"--schedule {'|'.join(SCHEDULES)}" in docs


@pytest.mark.parametrize("command", ["tune", "scaling", "compare"])
def test_a_command_that_ranks_by_a_probe_on_unlabelled_data_fails_before_ray_naming_eval_probes(
    command, img2dataset_dir, tmp_path, ray_forbidden
):
    args = {
        "tune": ["tune", "--space", "tune_spaces/noise_schedule.yaml", f"data.train_uri={img2dataset_dir}"],
        "scaling": ["scaling", "--sizes", "10,20", "--data", str(img2dataset_dir), "--name", "s"],
        "compare": ["compare", "--objectives", "mdc,ar", "--data", str(img2dataset_dir)],
    }[command]
    store = [f"storage_uri={tmp_path}", f"mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}", "data.val_uri=null"]
    result = CliRunner().invoke(app, [*args, *store])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error:") and "needs eval.probes" in line and str(img2dataset_dir) in line
