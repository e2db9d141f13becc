"""Data parallel: every step, gradients are summed over all ranks and divided by the
cluster's unit count, so every rank applies the same update (DESIGN promise 1). One rank
is the case with no one to sum with."""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np

from ..cluster.world import World
from ..control.step_plan import Decision
from ..engine.base import Engine, StepStats
from ..tasks import Batch
from ..tasks.metrics import MetricSums, means
from .model_state import StateSync


class DataParallel:
    def __init__(self, world: World, reducer):
        self.world, self.reducer = world, reducer
        self.drift_check = world.size > 1
        self.state_sync = StateSync(world)

    def describe(self) -> str | None:
        return None

    def trains(self, step: int) -> bool:
        return True

    def step(self, engine: Engine, lr: float) -> StepStats:
        self.world.rendezvous("waiting for the other ranks to finish computing")
        local = engine.take_gradients()
        grads, sync = self.reducer.all_sum(local.arrays)
        loss_sum, count, *metrics = self.world.allreduce_sum([local.loss_sum, local.count,
                                                              *local.metrics.flat(local.count)])
        stats = engine.apply_gradients(grads, loss_sum, int(count), lr)
        stats.metrics = means(local.metrics.names(), metrics)
        self.state_sync(engine, local.count)
        stats.sync_seconds, stats.sync_bytes, stats.sync_overlapped = sync.seconds, sync.bytes, sync.overlapped
        return stats

    def before_last_backward(self, engine: Engine) -> None:
        self.reducer.arm(engine)

    def meets(self, step: int) -> bool:
        return True  # they meet in the all-reduce anyway

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        return wanted  # every rank saw the same loss and norm, so the verdicts agree

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        return []

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        return []

    def whole_model(self, engine: Engine, ranks: Collection[int]) -> AbstractContextManager:
        return nullcontext()  # every rank holds the whole model

    def eval_losses(self, engine: Engine, batches: list[Batch], metrics: MetricSums) -> list[tuple[float, int]]:
        return [engine.eval_loss(b, metrics) for b in batches]

    def model_weights(self, engine: Engine) -> dict[str, np.ndarray]:
        return engine.get_weights()

    def state_dict(self, engine: Engine) -> dict[str, np.ndarray]:
        return {}

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        pass

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        return []

    def close(self) -> None:
        pass
