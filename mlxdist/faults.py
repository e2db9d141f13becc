"""Fault injection for tests, read from the environment: the only way a test can make a
real multi-process run drift, blow up, or run out of memory on cue.

  MLXDIST_INJECT_DRIFT=RANK:STEP   perturb RANK's weights after STEP (once)
  MLXDIST_INJECT_NAN=S1,S2,...     non-finite loss at those steps (each fires once)
  MLXDIST_INJECT_OOM=RANK:STEP     RANK's first micro-batch of STEP raises MemoryError (once)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _rank_step(name: str) -> tuple[int, int]:
    spec = os.environ.get(name)
    if not spec:
        return -1, -1
    rank, step = spec.split(":")
    return int(rank), int(step)


@dataclass
class Faults:
    drift: tuple[int, int] = (-1, -1)
    oom: tuple[int, int] = (-1, -1)
    nan_steps: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> Faults:
        nan = os.environ.get("MLXDIST_INJECT_NAN", "")
        return cls(_rank_step("MLXDIST_INJECT_DRIFT"), _rank_step("MLXDIST_INJECT_OOM"),
                   {int(s) for s in nan.split(",") if s.strip()})

    def take_nan(self, step: int) -> bool:
        if step in self.nan_steps:
            self.nan_steps.discard(step)
            return True
        return False

    def take_oom(self, rank: int, step: int) -> bool:
        if self.oom == (rank, step):
            self.oom = (-1, -1)
            return True
        return False

    def drift_now(self, rank: int, step: int) -> bool:
        """Once: a drift repair that restores a checkpoint replays the step."""
        if self.drift == (rank, step):
            self.drift = (-1, -1)
            return True
        return False
