"""Checkpoints.

Training state is a `torch.distributed.checkpoint` (DCP) directory in the run's storage,
`RUN_DIR/checkpoint_XXXXXXXX` (local or S3): every rank writes its own shard of the model,
optimiser and EMA state, and rank 0 writes `states.json`, the state of every other component the
checkpointer was given (a `Stateful`: the trainer's progress, the scheduler, the data position).
A checkpoint is *complete* only
once every rank's files are in place and rank 0 has written `complete.json` after them, listing
every file with its size and CRC-32: a directory without it (a worker died while saving) or whose
files do not match it (damaged) is never resumed from; `newest_complete` picks the newest one that
is whole and says why it skipped the others. mdc, not Ray Train, owns these directories, so a
worker group that dies between saving and reporting loses nothing.

For evaluation, `export_weights` writes the full unsharded weights as `model.safetensors` beside
the run's `config.yaml`; `load_pretrained` reads them back on one process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from mdc.config import load_exported_config
from mdc.data import storage
from mdc.data.tokenizer import CaptionTokenizer
from mdc.registry import build_model

STATES = "states.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
MARKER = "complete.json"
_CHECKPOINT_DIR = re.compile(r"checkpoint_(\d{8})")
_CHUNK = 8 * 1024 * 1024


def checkpoint_dir(run_dir: str, step: int) -> str:
    return storage.join(run_dir, f"checkpoint_{step:08d}")


class Stateful(Protocol):
    """A component with checkpoint state of its own, small and JSON-able (what is large and
    sharded, model, optimiser and EMA, goes through DCP instead). `state_dict` is called on every
    rank at a save, so it may be a collective; rank 0's is saved, and every rank of the group that
    resumes loads it: a component's state is the group's, never one rank's, so that it restores on
    any number of workers."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _state(model, optimizer, ema) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def stage_training_state(
    directory: str | Path, model, optimizer, ema, states: Mapping[str, Stateful], rank: int
) -> None:
    """Collective: every rank writes its DCP shard into its own local `directory` and gathers the
    `states` (rank 0 also writes the DCP metadata and states.json); `upload_shard` then moves
    them into the run's storage."""
    dcp.save(_state(model, optimizer, ema), checkpoint_id=str(directory))
    saved = {name: component.state_dict() for name, component in states.items()}
    if rank == 0:
        Path(directory, STATES).write_text(json.dumps(saved))


def upload_shard(local_dir: str | Path, uri: str, endpoint_url: str | None = None) -> dict[str, dict]:
    """Copy this rank's staged files into checkpoint `uri`; returns {name: {size, crc32}} of them."""
    fs, path = storage.open_fs(uri, endpoint_url)
    fs.create_dir(path, recursive=True)
    written = {}
    for file in sorted(Path(local_dir).iterdir()):
        crc, size = 0, 0
        with open(file, "rb") as src, fs.open_output_stream(f"{path}/{file.name}") as dst:
            while chunk := src.read(_CHUNK):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
                dst.write(chunk)
        written[file.name] = {"size": size, "crc32": crc}
    return written


def commit(
    uri: str, step: int, written: dict[str, dict], rank: int, endpoint_url: str | None = None, group=None
) -> None:
    """Collective (over `group`, default: all ranks), after `upload_shard` on every rank: rank 0
    writes the completion marker listing every rank's files; when this returns on any rank, the
    checkpoint is complete."""
    world = dist.get_world_size(group)
    by_rank: list = [None] * world
    dist.all_gather_object(by_rank, written, group=group)  # also the barrier: every rank's files are in place
    if rank == 0:
        files = {name: meta for shard in by_rank for name, meta in shard.items()}
        marker = {"step": step, "ranks": list(range(world)), "files": files}
        storage.write_bytes(storage.join(uri, MARKER), json.dumps(marker, indent=1).encode(), endpoint_url)
    dist.barrier(group=group)  # nobody moves on (or dies) before the marker exists


class Background:
    """Finishes one checkpoint at a time in a thread (upload, commit, prune) while training goes
    on. Its collectives run on a gloo group of their own, apart from training's; `wait` blocks
    until the pending one is complete and re-raises what failed there. Collective to create."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mdc-checkpoint")
        self._pending = None

    def submit(self, finish) -> None:
        self.wait()
        self._pending = self._pool.submit(finish)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def remove(uri: str, endpoint_url: str | None = None) -> None:
    """Delete a checkpoint directory if it exists (a leftover of an interrupted save)."""
    fs, path = storage.open_fs(uri, endpoint_url)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)


def _checkpoints(run_dir: str, endpoint_url: str | None) -> list[tuple[int, str]]:
    """(step, uri) of every checkpoint_XXXXXXXX directory in the run, newest first."""
    fs, path = storage.open_fs(run_dir, endpoint_url)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return []
    found = []
    for info in fs.get_file_info(pafs.FileSelector(path)):
        match = _CHECKPOINT_DIR.fullmatch(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            found.append((int(match.group(1)), storage.join(run_dir, info.base_name)))
    return sorted(found, reverse=True)


def problem(uri: str, endpoint_url: str | None = None, checksums: bool = True) -> str | None:
    """Why checkpoint `uri` cannot be resumed from, or None when it is complete and intact.
    Without `checksums` only names and sizes are compared (a listing, no reads)."""
    fs, path = storage.open_fs(uri, endpoint_url)
    try:
        marker = json.loads(storage.read_bytes(storage.join(uri, MARKER), endpoint_url))
        expected = marker["files"]
    except storage.StorageError:
        return f"no {MARKER}: a worker stopped before every shard was written"
    except (ValueError, KeyError, TypeError):
        return f"{MARKER} is unreadable"
    sizes = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(path)) if i.type == pafs.FileType.File}
    for name, meta in expected.items():
        if name not in sizes:
            return f"{name} is missing"
        if sizes[name] != meta["size"]:
            return f"{name} has {sizes[name]} bytes, {MARKER} says {meta['size']}"
    if checksums:
        for name, meta in expected.items():
            crc = 0
            with fs.open_input_stream(f"{path}/{name}") as f:
                while chunk := f.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
            if crc != meta["crc32"]:
                return f"{name} does not match its CRC-32 in {MARKER}"
    return None


def newest_complete(run_dir: str, endpoint_url: str | None = None) -> tuple[str | None, list[str]]:
    """The newest complete, intact checkpoint of the run (None if there is none), and one line per
    newer directory that was skipped, saying why."""
    skipped = []
    for step, uri in _checkpoints(run_dir, endpoint_url):
        reason = problem(uri, endpoint_url)
        if reason is None:
            return uri, skipped
        skipped.append(f"skipped {uri} (step {step}): {reason}")
    return None, skipped


def prune(run_dir: str, step: int, keep: int, endpoint_url: str | None = None) -> None:
    """After checkpoint `step` is complete: keep it and the newest `keep - 1` complete ones before
    it; delete the rest, including incomplete directories and any left from before a resume."""
    kept = 0
    for other, uri in _checkpoints(run_dir, endpoint_url):
        if other <= step and kept < keep and problem(uri, endpoint_url, checksums=False) is None:
            kept += 1
        else:
            remove(uri, endpoint_url)


@contextlib.contextmanager
def local_copy(uri: str, endpoint_url: str | None = None):
    """A local directory with the files of checkpoint `uri` (the directory itself when local)."""
    if not storage.is_s3(uri):
        yield uri
        return
    fs, path = storage.open_fs(uri, endpoint_url)
    with tempfile.TemporaryDirectory() as directory:
        pafs.copy_files(path, directory, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield directory


def marked_step(uri: str, endpoint_url: str | None = None) -> int:
    """The step checkpoint `uri` was saved at, as its completion marker says."""
    return json.loads(storage.read_bytes(storage.join(uri, MARKER), endpoint_url))["step"]


def load_training_state(directory: str | Path, model, optimizer, ema, states: Mapping[str, Stateful]) -> None:
    """Collective: restores model, optimiser and EMA, and every component of `states`, in place.
    A component the checkpoint holds no state for is an error, not a silent fresh start."""
    if not Path(directory, STATES).is_file():  # read before any collective: every rank fails alike
        raise ValueError(
            f"checkpoint {directory} has no {STATES}: an mdc from before the components saved their own "
            "state wrote it; resume it with that version, or train under a new run name"
        )
    state = _state(model, optimizer, ema)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    saved = json.loads(Path(directory, STATES).read_text())
    missing = sorted(states.keys() - saved.keys())
    if missing:
        raise KeyError(f"checkpoint {directory} holds no state for {', '.join(missing)}")
    for name, component in states.items():
        component.load_state_dict(saved[name])


def full_weights(model, ema=None) -> dict[str, torch.Tensor]:
    """Collective: the unsharded float32 weights on CPU (the EMA weights when EMA is on)."""
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ema is not None:
        weights = {
            name: (value.full_tensor() if hasattr(value, "full_tensor") else value).cpu()
            for name, value in ema.state_dict().items()
        }
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
            pafs.copy_files(
                f"{path}/{name}",
                str(partial / name),
                source_filesystem=fs,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise FileNotFoundError(
                f"{storage.join(uri, name)} cannot be read: not an exported mdc "
                f"checkpoint, or the store is unreachable ({e})"
            ) from e
    shutil.rmtree(local, ignore_errors=True)  # an incomplete copy from an interrupted download
    try:
        partial.rename(local)
    except OSError:  # another process (e.g. a second inference actor) finished the same download
        shutil.rmtree(partial, ignore_errors=True)
    return local


def read_weights(uri: str, endpoint_url: str | None = None) -> dict[str, torch.Tensor]:
    """The exported weights of checkpoint `uri` in memory (of an s3:// one only the weights file
    and config are downloaded, into a folder removed afterwards)."""
    with tempfile.TemporaryDirectory() as cache:
        return load_file(str(fetch_checkpoint(uri, endpoint_url, cache) / WEIGHTS))


def load_pretrained(
    directory: str | Path, device: str = "cpu", endpoint_url: str | None = None, cache_dir: str | Path | None = None
):
    """(model in eval mode, RunConfig) from an exported checkpoint directory (local or s3://)."""
    directory = fetch_checkpoint(directory, endpoint_url, cache_dir)
    for name in (WEIGHTS, CONFIG):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing: not an exported mdc checkpoint")
    cfg = load_exported_config(directory / CONFIG)
    model = build_model(cfg, CaptionTokenizer)
    model.load_state_dict(load_file(str(directory / WEIGHTS), device=device))
    return model.to(device).eval(), cfg
