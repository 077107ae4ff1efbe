"""Random draws from a generator of the caller's own, never from torch's global one.

mdc is a library and its callers have threads (`mdc study` evaluates one run while another builds
a model): torch's global generator is one per process, so a seed set on it by one thread is drawn
from by every other. Code that draws where no `generator=` argument reaches (timm's and torch's
weight initialisers, torchvision's crop parameters) runs inside `drawing_from(generator)`: a
dispatch mode, which is thread-local, hands `generator` to every random op of this thread, so a
model built from seed s has the same weights whatever other threads do meanwhile — and the same
weights as seeding the process-wide generator with s would give (the same Mersenne Twister, from the same seed).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _takes_generator(op) -> bool:
    return any(arg.name == "generator" for arg in op._schema.arguments)


def _with_generator(op):
    """The overload of `op` that takes a generator (`aten.randn.default` → `aten.randn.generator`)."""
    if _takes_generator(op):
        return op
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[1])
    for name in packet.overloads():
        overload = getattr(packet, name)
        if _takes_generator(overload) and len(overload._schema.arguments) == len(op._schema.arguments) + 1:
            return overload
    raise RuntimeError(f"{op} draws random numbers and has no form that takes a generator")


class _DrawingFrom(TorchDispatchMode):
    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            func = _with_generator(func)
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


def generator(seed: int) -> torch.Generator:
    """A CPU generator started from `seed`."""
    return torch.Generator().manual_seed(seed)


@contextmanager
def drawing_from(source: torch.Generator | int):
    """Every random op this thread runs inside the block draws from `source` (a generator, or a seed
    for a fresh CPU one) unless it was given a generator of its own. CPU draws only: building
    models and drawing crop boxes happen on the host."""
    with _DrawingFrom(generator(source) if isinstance(source, int) else source):
        yield
