"""The exported encoder is a timm folder anyone can load: without mdc importable, timm's own
`local-dir:` loader gives the same patch tokens as mdc's encoder; and the probe harness measures an
exported folder exactly as it measures the checkpoint it came from."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mdc import export
from mdc.config import RunConfig, dump_config
from mdc.data import storage
from mdc.evaluation import probe
from mdc.training.checkpoint import CONFIG, WEIGHTS, export_weights
from pipelines.cli import app

# Runs in a fresh interpreter outside the repository with `mdc` made unimportable: only timm and torch.
TIMM_ONLY = textwrap.dedent(
    """
    import sys
    sys.modules["mdc"] = None  # `import mdc` now raises ImportError
    import numpy as np, timm, torch
    try:
        import mdc
    except ImportError:
        pass
    else:
        raise SystemExit("mdc is importable")
    model = timm.create_model("local-dir:" + sys.argv[1], pretrained=True).eval()
    images = torch.from_numpy(np.load(sys.argv[2]))
    with torch.no_grad():
        np.save(sys.argv[3], model.forward_features(images).numpy())
    """
)


def checkpoint_of(cfg: RunConfig, directory):
    """An exported (untrained) checkpoint of `cfg`'s model, as training writes one."""
    export_weights(directory, probe.random_init(cfg, seed=0).state_dict(), dump_config(cfg))
    return directory


@pytest.mark.parametrize("preset", ["tiny", "vit_b32"])
def test_timm_alone_reproduces_mdc_patch_tokens(preset, tmp_path):
    cfg = RunConfig.model_validate({"model": {"preset": preset}, "data": {"max_length": 16}})
    model = probe.random_init(cfg, seed=0)
    folder = export.export_encoder(model, cfg, tmp_path / "encoder")
    size = model.image_size
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "images.npy", images.numpy())
    subprocess.run(
        [sys.executable, "-c", TIMM_ONLY, str(folder), str(tmp_path / "images.npy"), str(tmp_path / "tokens.npy")],
        cwd=tmp_path,
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    with torch.no_grad():
        expected = model.encode(images).numpy()
    tokens = np.load(tmp_path / "tokens.npy")
    assert tokens.shape == expected.shape  # no class token: one token per patch
    assert np.abs(tokens - expected).max() <= 1e-5
    config = json.loads((folder / "config.json").read_text())
    assert config["num_classes"] == 0 and config["model_args"]["class_token"] is False
    assert config["pretrained_cfg"]["input_size"] == [3, size, size]


def test_timms_transform_from_the_exported_folder_makes_the_inputs_mdc_trained_on(tmp_path):
    """A user of the folder prepares images with timm's own `resolve_data_config` and
    `create_transform`: on images whose centre crop falls on whole pixels they must equal mdc's
    training transform (bicubic resize, centre crop, CLIP's mean and std, each pinned by value)."""
    import timm.data
    from PIL import Image

    from mdc.data.images import ImageTransform

    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    model = probe.random_init(cfg, seed=0)
    folder = export.export_encoder(model, cfg, tmp_path / "encoder")
    pretrained = json.loads((folder / "config.json").read_text())["pretrained_cfg"]
    assert pretrained["mean"] == [0.48145466, 0.4578275, 0.40821073]  # CLIP's, as open_clip publishes them
    assert pretrained["std"] == [0.26862954, 0.26130258, 0.27577711]
    encoder = timm.create_model(f"local-dir:{folder}", pretrained=True)
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=encoder))
    size, rng = model.image_size, np.random.default_rng(0)
    for width, height in ((size, size), (2 * size, size), (size, 3 * size), (4 * size, 4 * size)):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        np.testing.assert_allclose(transform(image).numpy(), ImageTransform(size)(image), atol=1e-6, rtol=0)


def test_export_command_writes_timm_folder_card_and_captioner(tmp_path):
    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    checkpoint = checkpoint_of(cfg, tmp_path / "run" / "checkpoint_00000010")
    result = CliRunner().invoke(app, ["export", str(checkpoint), "--to", str(tmp_path / "out"), "--mlflow-uri", ""])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", "captioner"}
    assert (out / "captioner" / WEIGHTS).read_bytes() == (checkpoint / WEIGHTS).read_bytes()
    assert (out / "captioner" / CONFIG).read_text() == (checkpoint / CONFIG).read_text()
    card = (out / "README.md").read_text()
    assert "objective: `mdc`" in card and 'timm.create_model("local-dir:' in card
    assert f'timm.create_model("local-dir:{out}", pretrained=True)' in result.output.splitlines()[-1]


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["export", str(tmp_path / "nowhere"), "--to", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and str(tmp_path / "nowhere") in result.output


def probe_accuracy(tmp_path, name, *source):
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(
        app,
        ["eval", "probe", *source, "--dataset", "shapes", "--root", str(tmp_path / "shapes")]
        + ["--out", str(out), "--mlflow-uri", "", "--no-baseline"],
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["accuracy"]


def test_exported_folder_and_checkpoint_probe_the_same(shapes_dir, tmp_path):
    (tmp_path / "shapes").symlink_to(shapes_dir)
    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    checkpoint = checkpoint_of(cfg, tmp_path / "checkpoint")
    folder = export.export_checkpoint(checkpoint, tmp_path / "encoder", with_captioner=False)
    from_checkpoint = probe_accuracy(tmp_path, "checkpoint", "--checkpoint", str(checkpoint))
    from_folder = probe_accuracy(tmp_path, "folder", "--encoder", f"local-dir:{folder}")
    assert from_folder == from_checkpoint
    timm_reference = probe_accuracy(tmp_path, "timm", "--encoder", "timm:test_vit")  # a class token, mean 0.5
    assert 0.0 <= timm_reference <= 1.0


def test_an_unknown_encoder_is_one_line(tmp_path):
    for spec, named in (("timm:no_such_vit", "no_such_vit"), (f"local-dir:{tmp_path}", "config.json")):
        result = CliRunner().invoke(
            app, ["eval", "probe", "--encoder", spec, "--dataset", "shapes", "--root", str(tmp_path)]
        )
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and named in result.output


def compositionality(tmp_path, shapes_dir, name, *source) -> dict:
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(
        app,
        ["eval", "compositionality", *source, "--benchmark", "sugarcrepe"]
        + ["--root", str(shapes_dir / "compositionality"), "--samples", "2", "--limit", "4"]
        + ["--out", str(out), "--mlflow-uri", ""],
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_compositionality_scores_the_exported_encoder_with_its_text_side(shapes_dir, tmp_path):
    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    checkpoint = checkpoint_of(cfg, tmp_path / "checkpoint")
    folder = export.export_checkpoint(checkpoint, tmp_path / "encoder")
    original = compositionality(tmp_path, shapes_dir, "checkpoint", "--checkpoint", str(checkpoint))
    exported = compositionality(tmp_path, shapes_dir, "folder", "--encoder", f"local-dir:{folder}")
    assert exported["accuracy"] == original["accuracy"]
    result = CliRunner().invoke(
        app,
        ["eval", "compositionality", "--encoder", "timm:vit_tiny_patch16_224", "--benchmark", "aro"]
        + ["--root", str(tmp_path)],
    )
    assert result.exit_code == 2 and "has no text side" in result.output


def test_export_to_s3(s3_server, tmp_path):
    bucket = s3_server.make_bucket("exports")
    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    checkpoint = checkpoint_of(cfg, tmp_path / "checkpoint")
    result = CliRunner().invoke(
        app, ["export", str(checkpoint), "--to", f"{bucket}/tiny", "--endpoint-url", s3_server.endpoint_url]
    )
    assert result.exit_code == 0, result.output
    names = storage.list_files(f"{bucket}/tiny", endpoint_url=s3_server.endpoint_url)
    assert sorted(n.removeprefix(f"{bucket}/tiny/") for n in names) == [
        "README.md",
        "captioner/config.yaml",
        "captioner/model.safetensors",
        "config.json",
        "model.safetensors",
    ]
    assert "copy s3://exports/tiny to DIR, then" in result.output.splitlines()[-1]
