"""Data parallel: every step, gradients are summed over all ranks and divided by the
cluster's unit count, so every rank applies the same update (DESIGN promise 1). One rank
is the case with no one to sum with. Every other hook is `Strategy`'s default."""

from __future__ import annotations

from ..cluster.world import World
from ..config import Config
from ..control.run_plan import RunPlan
from ..engine.base import Engine, StepStats
from ..tasks.metrics import means
from .model_state import StateSync
from .strategy import Strategy


class DataParallel(Strategy):
    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer=None,
                 transport=None):
        self.world, self.reducer = world, reducer
        self.drift_check = world.size > 1
        self.state_sync = StateSync(world)

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
