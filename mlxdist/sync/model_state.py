"""The model's state beyond its trained parameters, kept equal on every rank.

BatchNorm's running statistics, other buffers, and state a task's own code writes outside
autograd change during a step on each rank from its own samples, so ranks would drift
apart (and a checkpoint would hold rank 0's alone). After each update the entries that
changed on any rank are agreed on: running statistics (`running_mean`, `running_var`) as
the average over ranks weighted by each rank's units, which for the running mean is
exactly what one process with the whole batch computes; everything else as rank 0 has it.
Entries nothing wrote cost nothing but a small all-gather of names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..cluster.world import World

if TYPE_CHECKING:
    from ..engine.base import ModelState

RUNNING_STATS = ("running_mean", "running_var")


def is_running_stat(name: str, value: np.ndarray) -> bool:
    return name.rsplit(".", 1)[-1] in RUNNING_STATS and value.dtype.kind == "f"


class StateSync:
    def __init__(self, world: World):
        self.world = world
        self.active: bool | None = None  # decided at the first step: does the model have such state?

    def __call__(self, tracker: ModelState, units: float) -> None:
        """Collective: every rank calls it after the same update, with the units it trained on.
        `tracker` is the model's state (`engine.model_state`, or a your-loop model's tracker)."""
        if self.active is None:
            self.active = self.world.size > 1 and tracker.has_state()
        if not self.active:
            return
        names = sorted(set().union(*self.world.allgather(tracker.changed_state())))
        if not names:
            return
        state = tracker.get_state(names)
        stats = {n: v for n, v in state.items() if is_running_stat(n, v)}
        agreed: dict[str, np.ndarray] = {}
        if stats:
            total = self.world.allreduce_sum([float(units)])[0]
            if total > 0:
                sums = self.world.allreduce_arrays({n: v.astype(np.float64) * units for n, v in stats.items()})
                agreed = {n: (sums[n] / total).astype(stats[n].dtype) for n in stats}
        rest = {n: v for n, v in state.items() if n not in agreed}
        if rest:
            agreed |= self.world.broadcast_arrays(rest)
        tracker.set_state(agreed)
