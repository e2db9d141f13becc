"""Data parallel: every step, gradients are summed over all ranks and divided by the
cluster's unit count, so every rank applies the same update (DESIGN promise 1). One rank
is the case with no one to sum with. Every other hook is `Strategy`'s default."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..cluster.world import World
from ..config import Config
from ..control.run_plan import RunPlan
from ..control.step_plan import Decision
from ..engine.base import Engine, StepStats
from ..tasks.metrics import means
from .model_state import StateSync
from .reducer import Reducer, Unreduced
from .strategy import Strategy, load_rank_files, save_rank_file


class DataParallel(Strategy):
    shardable = True  # dist.shard runs it as ZeRO-1/2/3 (sharded.py, fully_sharded.py)

    def __init__(self, cfg: Config, world: World, engine: Engine, plan: RunPlan, reducer: Reducer | None = None,
                 transport=None):
        self.world, self.hosts = world, list(plan.hosts)
        self.reducer = reducer if reducer is not None else Unreduced()
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
        self.state_sync(engine.model_state, local.count)
        stats.sync_seconds, stats.sync_bytes, stats.sync_overlapped = sync.seconds, sync.bytes, sync.overlapped
        return stats

    def before_last_backward(self, engine: Engine) -> None:
        if engine.capabilities.overlap:
            self.reducer.arm(engine.gradients)

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        """The reducer's own state (a lossy wire's residuals), when it keeps any."""
        if not self.reducer.keeps_rank_state:
            return
        save_rank_file(self.world, self.hosts, root, step, self.reducer.rank_state(), keep)  # no update count read back

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """The reducer's state from this rank's file of `step`, on every rank or on none (the
        ranks must agree on what they send); a fresh run starts it afresh."""
        if not self.reducer.keeps_rank_state:
            return []
        own, _, why = load_rank_files(self.world, self.hosts, root, step) if shared is not None else (None, None, "")
        self.reducer.load_rank_state(own)
        if not why:
            return []
        return [Decision("wire_resume", f"dist.wire_dtype: the wire's error-feedback residuals restart at zero "
                         f"({why}): the rounding not yet sent before the checkpoint is dropped, once")]

