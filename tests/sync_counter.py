"""A counter of every kind of host sync a step can make, seen where torch dispatches its ops
(docs/testing.md): reads of a value (`item`, `bool`, `int`, `float`, `__index__` all reach
`aten._local_scalar_dense`), ops whose output shape depends on the data (`nonzero`,
`masked_select`, boolean-mask `index` and `index_put`, `bincount`, ...), device-to-host copies,
and every collective (`c10d.*`). On CUDA each makes the host wait for the device.

Two gaps of a CPU-only run are closed by hand: a CPU tensor's `tolist`, `numpy` and `cpu`
dispatch nothing (on CUDA they are a device-to-host copy), so those methods are counted when
called; and host-side code that reads tensors it made on the host (never device tensors in a GPU
run) is named in `HOST_SIDE` with the reason, and its ops are not counted."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# (file suffix, function) -> why its ops touch host tensors only, in a GPU run too
HOST_SIDE = {
    ("torch/optim/optimizer.py", "_get_value"): "the optimiser's step count: a CPU tensor unless capturable or fused",
    ("mdc/data/augment.py", "draws"): "crop boxes drawn from the host's generator",
    ("pipelines/data/position.py", "add"): "the data cursor's tally of the batch's host tensors (shard ids, rows)",
}
UNDISPATCHED_READS = ("tolist", "numpy", "cpu")  # host reads a CPU tensor makes without dispatching an op
BOOL_INDEXED = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
COPIES = (aten._to_copy.default, aten.copy_.default)


def sync_kind(func, args, kwargs) -> str | None:
    """The kind of host sync `func` on these arguments makes, or None."""
    if func.namespace == "c10d":
        return "collective"
    if func in BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        bool_index = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
        return "boolean index" if bool_index else None
    if func in COPIES:
        source, target = (args[0], kwargs.get("device")) if func is COPIES[0] else (args[1], args[0].device)
        host = target is not None and torch.device(target).type == "cpu"
        return "device-to-host copy" if host and source.device.type != "cpu" else None
    if torch.Tag.data_dependent_output in func.tags:
        return "scalar read"
    if torch.Tag.dynamic_output_shape in func.tags:
        return "data-dependent shape"
    return None


def host_side(frame) -> str | None:
    """The HOST_SIDE entry this frame or a caller runs in, if any."""
    while frame is not None:
        code = frame.f_code
        for (suffix, name), why in HOST_SIDE.items():
            if code.co_name == name and code.co_filename.endswith(suffix):
                return why
        frame = frame.f_back
    return None


def project_caller(frame) -> str:
    """`path:line` of the innermost frame outside torch and this module: where the sync was asked for."""
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("sync_counter.py"):
            return f"{'/'.join(name.split('/')[-2:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class SyncCounter(TorchDispatchMode):
    """Inside its `with`, records (kind, op, caller) per `step` in `syncs` (the dispatch mode and
    the method patches together)."""

    def __init__(self):
        super().__init__()
        self.step, self.syncs = 0, {}

    def record(self, kind: str, op: str) -> None:
        frame = sys._getframe(2)
        if host_side(frame) is None:
            self.syncs.setdefault(self.step, []).append((kind, op, project_caller(frame)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.record(kind, str(func))
        return func(*args, **kwargs)

    def kinds(self, step: int) -> list[str]:
        return [kind for kind, _, _ in self.syncs.get(step, [])]

    @contextlib.contextmanager
    def patched_reads(self):
        originals = {name: getattr(torch.Tensor, name) for name in UNDISPATCHED_READS}

        def counted(name):
            def read(tensor, *args, **kwargs):
                self.record("host read", f"Tensor.{name}")
                return originals[name](tensor, *args, **kwargs)

            return read

        try:
            for name in UNDISPATCHED_READS:
                setattr(torch.Tensor, name, counted(name))
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def __enter__(self):
        self._reads = self.patched_reads()
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)
