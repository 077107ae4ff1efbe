"""`mdc export SOURCE --to DIR`: the encoder as a timm folder (`timm.create_model("local-dir:DIR",
pretrained=True)` loads it without mdc), with its model card and, by default, the whole captioner
in `captioner/`. SOURCE is a checkpoint directory (local or s3://), an MLflow run (`runs:/ID` or
its id) or a registered version (`models:/NAME/VERSION`, `models:/NAME@ALIAS`); DIR is local or
s3://."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import typer

from mdc import export
from mdc.data import storage
from mdc.training import checkpoint as ckpt
from pipelines.infra.console import console, user_errors

_RUN_ID = re.compile(r"[0-9a-f]{32}")


def export_command(
    source: str = typer.Argument(
        ...,
        help="checkpoint directory (local or s3://), MLflow run (runs:/ID or ID), or models:/NAME/VERSION | models:/NAME@ALIAS",
    ),
    to: str = typer.Option(..., "--to", help="destination folder, local or s3://"),
    captioner: bool = typer.Option(True, help="also the whole captioner in captioner/ (mdc's format)"),
    endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint for s3:// sources and destinations"),
    mlflow_uri: str = typer.Option("sqlite:///mlflow.db", help="MLflow tracking URI of runs:/ and models:/ sources"),
):
    """Export a checkpoint's encoder for timm (and anyone without mdc)."""
    with user_errors(FileNotFoundError, ValueError, RuntimeError):
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch, "export") if storage.is_s3(to) else Path(to)
            write(source, local, captioner, endpoint_url, mlflow_uri)
            written = sorted(p.name + ("/" if p.is_dir() else "") for p in local.iterdir())
            if storage.is_s3(to):
                upload(local, to, endpoint_url)
    console.print(f"wrote {to}: {', '.join(written)}")
    folder = "DIR" if storage.is_s3(to) else str(Path(to).resolve())
    copy_first = f"copy {to} to DIR, then " if storage.is_s3(to) else ""
    console.print(f'load it with: {copy_first}timm.create_model("local-dir:{folder}", pretrained=True)')


def write(source: str, directory: Path, captioner: bool, endpoint_url: str | None, mlflow_uri: str) -> None:
    """The export of `source` in the local folder `directory`."""
    if source.startswith("models:/"):
        from pipelines.run import model_registry  # MLflow: seconds to import, only for registry sources

        shutil.copytree(model_registry.resolve(source, mlflow_uri), directory, dirs_exist_ok=True)
        if not captioner:
            shutil.rmtree(directory / export.CAPTIONER, ignore_errors=True)
        return
    if source.startswith("runs:/") or _RUN_ID.fullmatch(source):
        from pipelines.run import model_registry  # MLflow: seconds to import, only for run sources

        checkpoint, facts = model_registry.run_checkpoint(mlflow_uri, source, endpoint_url)
    else:
        checkpoint, facts = source, checkpoint_facts(source, endpoint_url)
    export.export_checkpoint(checkpoint, directory, facts, captioner, endpoint_url)


def checkpoint_facts(checkpoint: str, endpoint_url: str | None) -> dict:
    """The model card's provenance of a checkpoint: where it is, and its step when it says."""
    facts = {"checkpoint": checkpoint}
    try:
        facts["step"] = ckpt.marked_step(checkpoint, endpoint_url)
    except (OSError, storage.StorageError, KeyError, ValueError):  # an export copied out of its run
        pass
    return facts


def upload(local: Path, uri: str, endpoint_url: str | None) -> None:
    fs, path = storage.open_fs(uri, endpoint_url)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
