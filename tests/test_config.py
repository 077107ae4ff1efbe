import pytest
import yaml
from typer.testing import CliRunner

from mdc.config import (
    DEFAULT_CONFIG,
    MOVED,
    ConfigError,
    RunConfig,
    build_config,
    derive,
    dump_config,
    load_config,
    load_exported_config,
)
from pipelines.cli import app


def test_defaults_are_the_demo_config():
    assert load_config(DEFAULT_CONFIG) == RunConfig()
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.objective.name == "mdc"
    assert (cfg.objective.omega_l, cfg.objective.omega_u) == (0.5, 1.0)
    assert cfg.model.preset == "tiny"


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: sweep-a\nobjective:\n  name: cmlm\n  omega_l: 0.2\ntrain:\n  batch_size: 8\n")
    cfg = load_config(
        path, ["objective.omega_l=0.7", "train.steps=5", "model.time_conditioning=true", "data.val_uri=null"]
    )
    assert cfg.name == "sweep-a"
    assert cfg.objective.name == "cmlm"
    assert cfg.objective.omega_l == 0.7  # the override beats the file
    assert cfg.train.batch_size == 8
    assert cfg.train.steps == 5
    assert cfg.model.time_conditioning is True
    assert cfg.data.val_uri is None


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["objective.name=bert", "objective.mask_ratio=0.5"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_schedule_order_is_checked():
    with pytest.raises(ConfigError, match="omega_l must be < omega_u, got 0.7 >= 0.5"):
        load_config(None, ["objective.omega_l=0.7", "objective.omega_u=0.5"])


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.foo=1", "model.foo"),
        ("train.batch_size=0", "train.batch_size"),
        ("objective.omega_u=1.5", "objective.omega_u"),
        ("objective.name=gan", "objective.name"),
        ("model.preset=vit_h14", "model.preset"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{field}:" in str(err.value)


def test_unknown_field_is_called_unknown():
    with pytest.raises(ConfigError, match="model.foo: unknown field"):
        build_config({"model": {"foo": 1}})


def test_override_needs_an_equals_sign():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.steps"])


def test_override_cannot_descend_into_a_value(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: sweep-a\n")
    with pytest.raises(ConfigError, match="'name' is not a section"):
        load_config(path, ["name.x=1"])


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file not found: {path}"):
        load_config(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_field_fails_in_one_line_naming_its_new_path(tmp_path, old, new):
    with pytest.raises(ConfigError) as override:
        load_config(None, [f"{old}=1"])
    section, field = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {field}: 1\n")
    with pytest.raises(ConfigError) as yaml_file:
        load_config(path)
    for err in (override, yaml_file):
        assert str(err.value).endswith(f"{old} is now {new}") and "\n" not in str(err.value)
    section, field = new.split(".")
    assert field in type(getattr(RunConfig(), section)).model_fields  # the new path exists


def test_no_validator_changes_what_the_user_wrote():
    cfg = load_config(None, ["workers.count=[3, 3]"])
    raw = RunConfig().model_dump()
    for section, fields in cfg.model_dump().items():
        assert section == "workers" or fields == raw[section]
    assert cfg.workers.count == (3, 3) and not cfg.workers.elastic and cfg.workers.max == 3


def test_a_field_of_another_objective_is_named_with_its_objectives():
    """One line per field, `objective.FIELD` (not pydantic's `objective.MEMBER.FIELD`), saying whose it is."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["objective.mask_ratio=0.2", "objective.parallel_prob=0.5"])
    assert str(err.value).splitlines()[1:] == [
        "  objective.mask_ratio: unknown field for 'mdc'; mask_ratio applies to bert (got 0.2)",
        "  objective.parallel_prob: unknown field for 'mdc'; parallel_prob applies to cappa (got 0.5)",
    ]
    with pytest.raises(ConfigError, match=r"objective.name: expected one of 'mdc', 'cmlm', .* \(got 'gan'\)"):
        load_config(None, ["objective.name=gan"])


def test_switching_objective_drops_the_old_ones_fields_and_keeps_the_shared_ones(tmp_path):
    base = load_config(None, ["objective.omega_l=0.2", "objective.image_free_prob=0.3"])
    assert derive(base, {"objective.name": "ar"}).objective.model_dump() == {"name": "ar"}
    cmlm = derive(base, ["objective.name=cmlm"]).objective
    assert (cmlm.name, cmlm.omega_l, cmlm.image_free_prob) == ("cmlm", 0.2, 0.3)
    bert = derive(base, {"objective.name": "bert", "objective.mask_ratio": 0.5}).objective
    assert bert.model_dump() == {"name": "bert", "image_free_prob": 0.3, "mask_ratio": 0.5}
    path = tmp_path / "run.yaml"
    path.write_text("objective:\n  name: mdc\n  omega_l: 0.2\n")
    assert load_config(path, ["objective.name=cappa"]).objective.model_dump() == {
        "name": "cappa",
        "parallel_prob": 0.75,
    }


def test_a_field_set_for_the_wrong_objective_is_still_an_error(tmp_path):
    with pytest.raises(ConfigError, match="objective.omega_l: unknown field for 'bert'; omega_l applies to mdc, cmlm"):
        derive(RunConfig(), {"objective.name": "bert", "objective.omega_l": 0.3})
    path = tmp_path / "run.yaml"
    path.write_text("objective:\n  name: bert\n  omega_l: 0.2\n")
    with pytest.raises(ConfigError, match="objective.omega_l: unknown field for 'bert'"):
        load_config(path)


def test_config_show_lists_an_objectives_own_fields():
    result = CliRunner().invoke(app, ["config", "show", "--objective", "cappa"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "objective.name=cappa: CapPa: Cap with parallel prediction",
        "  objective.parallel_prob: float = 0.75 (>= 0.0, <= 1.0) — share of captions trained by parallel "
        "prediction from all-[MASK] inputs",
    ]
    every = CliRunner().invoke(app, ["config", "show"]).output
    assert "objective.mask_ratio: float = 0.15" in every and "objective.name=clip" in every
    unknown = CliRunner().invoke(app, ["config", "show", "--objective", "gpt"])
    assert unknown.exit_code == 2 and "unknown objective 'gpt'" in unknown.output


def test_a_config_exported_by_the_version_before_the_sections_still_loads(tmp_path):
    """An export's config.yaml as the flat config dumped it (every objective field, train.* for the
    workers, checkpoints and compile) reads as today's sections and the objective's own fields."""
    old = {
        "name": "old-run",
        "objective": {
            "name": "bert",
            "omega_l": 0.5,
            "omega_u": 1.0,
            "antithetic": True,
            "mask_ratio": 0.3,
            "parallel_prob": 0.75,
            "image_free_prob": 0.0,
        },
        "train": {
            "steps": 40,
            "batch_size": 8,
            "num_workers": [1, 4],
            "checkpoint_every": 10,
            "val_every": 20,
            "compile": True,
            "use_gpu": False,
            "cpus_per_worker": 1.0,
            "global_batch_size": 32,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    cfg = load_exported_config(path)
    assert cfg.objective.model_dump() == {"name": "bert", "image_free_prob": 0.0, "mask_ratio": 0.3}
    assert (cfg.train.steps, cfg.workers.count, cfg.checkpoint.every, cfg.validation.every) == (40, (1, 4), 10, 20)
    assert cfg.compute.compile and cfg.workers.cpus == 1.0 and cfg.global_batch == 32
    with pytest.raises(ConfigError, match=r"train\.\w+ is now \w+\.\w+$"):
        load_config(path)  # a file the user wrote is told the new paths instead


def test_config_show_lists_every_field_of_a_section_and_every_section():
    """A newcomer finds each setting by its path: every field of every section is listed once."""
    workers = CliRunner().invoke(app, ["config", "show", "workers"])
    assert workers.exit_code == 0, workers.output
    lines = workers.output.splitlines()
    assert lines[0].startswith("workers: Ray Train's worker group")
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        f"workers.{f}" for f in RunConfig().workers.model_fields
    ]
    assert "workers.placement: 'PACK' | 'SPREAD' | 'STRICT_PACK' | 'STRICT_SPREAD' = 'PACK'" in workers.output
    every = CliRunner().invoke(app, ["config", "show"]).output
    for section in ("model", "data", "optim", "train", "checkpoint", "validation", "workers", "compute", "eval"):
        for field in type(getattr(RunConfig(), section)).model_fields:
            assert f"  {section}.{field}: " in every
    unknown = CliRunner().invoke(app, ["config", "show", "trian"])
    assert unknown.exit_code == 2 and "unknown config section 'trian'" in unknown.output


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["train.stpes=3"],
            "invalid override train.stpes=3: train.stpes: unknown field; did you mean train.steps? (got 3)",
        ),
        (
            ["trian.steps=3"],
            "invalid override trian.steps=3: trian: unknown field; did you mean train? (got {'steps': 3})",
        ),
        (["objective.omga_l=0.2"], "objective.omga_l: unknown field for 'mdc'; did you mean objective.omega_l?"),
        (
            ["eval.probes=[{dataset: cifar10, root: /x, nme: a}]"],
            "eval.probes.0.nme: unknown field; did you mean eval.probes.0.name?",
        ),
        (["train.zzzz=1"], "invalid override train.zzzz=1: train.zzzz: unknown field (got 1)"),
    ],
)
def test_an_unknown_field_names_the_override_and_the_closest_known_field(overrides, line):
    """One line, the override blamed (not the config file), pydantic-style did-you-mean (difflib)."""
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT_CONFIG, overrides)
    assert line in str(err.value) and "\n" not in str(err.value)
    assert "demo.yaml" not in str(err.value)
