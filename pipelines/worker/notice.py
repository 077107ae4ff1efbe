"""When the worker group reads a reclaim notice: about every `workers.notice_every_s` seconds of
rank 0's wall clock, whatever `train.log_every` is (a cloud's warning can be 30 s; at 50 steps a
log and a second a step, a notice read only on logged steps could come too late). Reading it is a
collective, so every rank must read it at the same step: each read also agrees, from rank 0, on
how many steps to the next (the interval over rank 0's mean step time since the last read). The
steps between reads run no collective and no host sync of their own."""

from __future__ import annotations

import time
from collections.abc import Callable


class NoticeSchedule:
    """The steps at which the notice is read. `due(step)` on every rank alike; at a read, rank 0's
    `gap(step)` is broadcast and every rank calls `agree(step, gap)`."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.start(0)

    def start(self, step: int) -> None:
        """The run goes on after `step` (0, or the checkpoint's): the next step reads the notice."""
        self.next_step = step + 1 if self.interval_s > 0 else None
        self.last_step, self.last_time = step, self.clock()

    def due(self, step: int) -> bool:
        return self.next_step is not None and step >= self.next_step

    def gap(self, step: int) -> int:
        """Rank 0: steps until the next read, `interval_s` at the mean step time since the last read."""
        now = self.clock()
        per_step = (now - self.last_time) / max(1, step - self.last_step)
        self.last_step, self.last_time = step, now
        return max(1, int(self.interval_s / per_step)) if per_step > 0 else 1

    def agree(self, step: int, gap: int) -> None:
        if self.next_step is not None:
            self.next_step = step + gap
