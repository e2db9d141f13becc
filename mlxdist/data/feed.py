"""The batches of each step, made ahead in the background with the plan of the moment."""

from __future__ import annotations

from ..control.step_plan import StepPlan
from .batch import BatchMaker
from .prefetch import Prefetcher


class StepFeed:
    """Batches for steps ahead are made with the plan as it was when the feed (re)started;
    a new plan, a rollback or a resume restarts it from the loop's step and position."""

    def __init__(self, maker: BatchMaker, depth: int):
        self.maker, self.depth = maker, depth
        self._prefetch: Prefetcher | None = None

    def restart(self, step: int, position: int, plan: StepPlan) -> None:
        self.close()
        frozen = plan.copy()
        self._prefetch = Prefetcher(
            lambda s: self.maker(position + (s - step) * frozen.global_batch, frozen),
            start=step, depth=self.depth)

    def get(self, step: int) -> list:
        assert self._prefetch is not None, "restart() the feed first"
        return self._prefetch.get(step)

    def take_wait_seconds(self) -> float:
        """Time the loop waited for data since the last call."""
        waited, self._prefetch.wait_seconds = self._prefetch.wait_seconds, 0.0
        return waited

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
