"""Checkpoints.

Training state is a `torch.distributed.checkpoint` (DCP) directory: every rank writes its own shard
of the model, optimiser and EMA state, and `trainer_state.json` holds the step, scheduler and data
epoch. For evaluation, `export_weights` writes the full unsharded weights as `model.safetensors`
beside the run's `config.yaml`; `load_pretrained` reads them back on one process.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from mdc import storage

TRAINER_STATE = "trainer_state.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"


def save_training_state(directory: str | Path, model, optimizer, scheduler, ema, trainer_state: dict,
                        rank: int) -> None:
    """Collective: call on every rank with the same directory (or a per-rank directory that is
    merged later, as Ray Train does)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    dcp.save(state, checkpoint_id=str(directory))
    if rank == 0:
        payload = {**trainer_state, "scheduler": scheduler.state_dict()}
        Path(directory, TRAINER_STATE).write_text(json.dumps(payload))


def load_training_state(directory: str | Path, model, optimizer, scheduler, ema) -> dict:
    """Collective: restores model, optimiser, scheduler and EMA in place; returns trainer_state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    payload = json.loads(Path(directory, TRAINER_STATE).read_text())
    scheduler.load_state_dict(payload.pop("scheduler"))
    return payload


def full_weights(model, ema=None) -> dict[str, torch.Tensor]:
    """Collective: the unsharded float32 weights on CPU (the EMA weights when EMA is on)."""
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ema is not None:
        weights = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).cpu()
                   for name, value in ema.state_dict().items()}
    return {name: value.float().contiguous() for name, value in weights.items()}


def export_weights(directory: str | Path, weights: dict[str, torch.Tensor], config_yaml: str) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(directory, WEIGHTS)))
    Path(directory, CONFIG).write_text(config_yaml)


def fetch_checkpoint(uri: str | Path, endpoint_url: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the exported weights and config of `uri`.

    Local paths are returned as they are. For s3:// only `model.safetensors` and `config.yaml` are
    downloaded (not the DCP shards beside them), into `cache_dir` (default ~/.cache/mdc/checkpoints)
    under a name derived from the URI; checkpoint directories are written once, so a cached copy is
    reused without asking the store again."""
    uri = str(uri)
    if not storage.is_s3(uri):
        return Path(uri)
    root = Path(cache_dir or Path.home() / ".cache" / "mdc" / "checkpoints")
    source = f"{storage.resolve_endpoint(endpoint_url)}|{uri.rstrip('/')}"
    local = root / hashlib.sha1(source.encode()).hexdigest()[:16]
    if all((local / name).is_file() for name in (WEIGHTS, CONFIG)):
        return local
    fs, path = storage.open_fs(uri, endpoint_url)
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
    for name in (WEIGHTS, CONFIG):
        try:
            pafs.copy_files(f"{path}/{name}", str(partial / name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise FileNotFoundError(f"{storage.join(uri, name)} cannot be read: not an exported mdc "
                                    f"checkpoint, or the store is unreachable ({e})") from e
    shutil.rmtree(local, ignore_errors=True)  # an incomplete copy from an interrupted download
    try:
        partial.rename(local)
    except OSError:  # another process (e.g. a second inference actor) finished the same download
        shutil.rmtree(partial, ignore_errors=True)
    return local


def load_pretrained(directory: str | Path, device: str = "cpu", endpoint_url: str | None = None,
                    cache_dir: str | Path | None = None):
    """(model in eval mode, RunConfig) from an exported checkpoint directory (local or s3://)."""
    from mdc.config import load_config
    from mdc.model import build_model
    from mdc.tokenizer import CaptionTokenizer

    directory = fetch_checkpoint(directory, endpoint_url, cache_dir)
    for name in (WEIGHTS, CONFIG):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing: not an exported mdc checkpoint")
    cfg = load_config(directory / CONFIG)
    model = build_model(cfg, CaptionTokenizer)
    model.load_state_dict(load_file(str(directory / WEIGHTS), device=device))
    return model.to(device).eval(), cfg
