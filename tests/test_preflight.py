"""Mistakes the config and the data's side files show are one line before Ray starts (issue 52):
no shards, a dataset smaller than one global batch, an S3 host that does not resolve, warmup past
the last step. Ray-free, seconds each."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mdc.config import ConfigError, load_config
from mdc.data import storage
from mdc.data.img2dataset import generated_rows, write_img2dataset_folder
from pipelines.infra import run_inputs

ROOT = Path(__file__).resolve().parent.parent


def config(train: Path | str, *more: str):
    return load_config(None, [f"data.train_uri={train}", "data.val_uri=null", *more])


def test_a_folder_of_plain_images_says_what_it_holds(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(b"jpeg")
    with pytest.raises(storage.StorageError) as err:
        run_inputs.check_data(config(tmp_path))
    message = str(err.value)
    assert message.startswith("data.train_uri: no .tar or .parquet shards under") and "it holds 3 .jpg" in message


@pytest.mark.parametrize("output_format", ["webdataset", "parquet"])
def test_a_dataset_smaller_than_one_global_batch_is_refused_from_its_side_files(tmp_path, output_format):
    stats = write_img2dataset_folder(generated_rows(20, 16), str(tmp_path), output_format, samples_per_shard=10)
    small = config(tmp_path, "train.batch_size=16", "workers.count=2")  # a global batch of 32
    with pytest.raises(
        ConfigError, match=rf"holds {stats['successes']} samples \(_stats.json\), fewer than one global batch of 32"
    ):
        run_inputs.check_data(small)
    run_inputs.check_data(config(tmp_path, "train.batch_size=8", "workers.count=2"))  # 16 fit
    if output_format == "parquet":  # without _stats.json: the Parquet footers say the size
        (tmp_path / "_stats.json").unlink()
        with pytest.raises(ConfigError, match="the footers of its 2 Parquet shards"):
            run_inputs.check_data(small)


def test_an_s3_host_that_does_not_resolve_names_data_endpoint_url(monkeypatch):
    def no_address(host, *args, **kwargs):
        raise socket.gaierror(f"no address for {host}")

    monkeypatch.setattr(run_inputs.socket, "getaddrinfo", no_address)
    cfg = config("s3://bucket/train", "data.endpoint_url=http://minio.lab:9000")
    with pytest.raises(storage.StorageError) as err:
        run_inputs.check_data(cfg)
    assert str(err.value).startswith("data.endpoint_url: data.train_uri s3://bucket/train is read from 'minio.lab'")
    assert "set data.endpoint_url=http://HOST:PORT" in str(err.value)


def test_warmup_past_the_last_step_is_a_warning():
    assert run_inputs.config_warnings(load_config(None, ["train.steps=20", "optim.warmup_steps=30"])) == [
        "optim.warmup_steps 30 >= train.steps 20: the learning rate never reaches optim.lr; "
        "set optim.warmup_steps below 20 (e.g. 2)"
    ]
    assert run_inputs.config_warnings(load_config(None, ["train.steps=200", "optim.warmup_steps=30"])) == []


def test_mdc_train_answers_a_data_mistake_in_one_line_without_torch_ray_or_mlflow(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"jpeg")
    code = (
        "import sys, json\nfrom typer.testing import CliRunner\nfrom pipelines.cli import app\n"
        f"r = CliRunner().invoke(app, ['train', '--data', {str(tmp_path)!r}])\n"
        "print(json.dumps([r.exit_code, r.output, [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    exit_code, output, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert exit_code == 2 and heavy == []
    assert output.count("\n") == 1 and output.startswith("error: data.train_uri: no .tar or .parquet shards")
