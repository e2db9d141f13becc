"""Which samples each rank trains on in each step.

A step always processes `global_batch` samples of the global stream. Rank r owns a
contiguous `shares[r]` of them and works through its part in micro-batches of at most
`micro[r]` (its memory-limited batch size). Shares may change (load balancing) and micro
sizes may change (memory), but the step's samples never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .control.split import micro_batches, proportional_split
from .data.datasets import Dataset
from .data.sampler import GlobalSampler, rank_slice


@dataclass
class StepPlan:
    global_batch: int
    shares: list[int]
    micro: list[int]

    @classmethod
    def initial(cls, micro: list[int], accum: int, global_batch: int | None) -> StepPlan:
        total = global_batch or sum(micro) * accum
        if total < len(micro):
            raise ValueError(f"train.global_batch: {total} is smaller than the number of ranks ({len(micro)})")
        return cls(total, proportional_split(total, [float(m) for m in micro]), list(micro))

    def accumulation(self, rank: int) -> int:
        return len(micro_batches(self.shares[rank], self.micro[rank]))


@dataclass
class BatchMaker:
    """Turns (stream position, plan, rank) into this rank's micro-batches for one step."""

    dataset: Dataset
    sampler: GlobalSampler
    rank: int

    def __call__(self, position: int, plan: StepPlan) -> list[np.ndarray]:
        begin, end = rank_slice(plan.shares, self.rank)
        mine = self.sampler.indices(position + begin, end - begin)
        out, offset = [], 0
        for n in micro_batches(len(mine), plan.micro[self.rank]):
            out.append(self.dataset.batch(mine[offset : offset + n]))
            offset += n
        return out
