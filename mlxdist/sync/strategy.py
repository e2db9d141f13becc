"""How ranks agree: the one object the loop holds for it, and never inspects.

A strategy owns the exchange of a step (gradients now, or nothing until an outer sync),
when the ranks meet to share control numbers (stop requests, re-plans, rollback), whether
the weight-drift check applies, what a checkpoint calls the model's weights, its own
checkpoint state, and `close`. Adding one is adding a module and a line to `make_strategy`.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import numpy as np

from ..cluster.world import World
from ..config import Config
from ..control.step_plan import Decision
from ..engine.base import Engine, StepStats
from ..tasks import Batch
from ..tasks.metrics import MetricSums


class SyncStrategy(Protocol):
    drift_check: bool  # whether all ranks should hold bit-identical weights after every step

    def describe(self) -> str | None:
        """A banner line, or None when there is nothing to say."""

    def trains(self, step: int) -> bool:
        """Whether this rank computes step `step` (1-based, about to run). Data parallel:
        always. Time-boxed DiLoCo: a slower rank sits some steps of a round out, so all ranks
        reach the outer sync together. A step sat out computes nothing, `step` returns the
        last stats unchanged, and the loop neither judges nor reports it."""

    def step(self, engine: Engine, lr: float) -> StepStats:
        """Exchange what this strategy exchanges per step, then update the engine."""

    def before_last_backward(self, engine: Engine) -> None:
        """The step's last micro-batch comes next: a strategy may start its exchange while
        that backward runs (torch data parallel sends buckets as gradients become final)."""

    def meets(self, step: int) -> bool:
        """Whether the ranks exchange control numbers after `step`."""

    def agree_on_rollback(self, wanted: bool, step: int) -> bool:
        """Whether every rank rolls back after `step`; all ranks return the same answer."""

    def after_step(self, engine: Engine, step: int, samples: int, last: bool) -> list[Decision]:
        """After the update of a step of `samples` samples here: anything due (outer syncs).
        `last`: the run reaches train.steps; it must end on one model."""

    def before_save(self, engine: Engine, step: int) -> list[Decision]:
        """Make the state whole for a checkpoint (land exchanges in flight)."""

    def whole_model(self, engine: Engine, ranks: Collection[int]) -> AbstractContextManager:
        """The whole model in the engine of `ranks` for the duration (a checkpoint's writers, a
        hook's rank): ZeRO-3 gathers its shards there, then lets go; the others hold it anyway.
        Collective, entered alike on every rank."""

    def eval_losses(self, engine: Engine, batches: list[Batch], metrics: MetricSums) -> list[tuple[float, int]]:
        """(summed loss, units) of each of this rank's evaluation batches; collective (ZeRO-3
        gathers each stage's weights, and every rank must take part in as many gathers)."""

    def model_weights(self, engine: Engine) -> dict[str, np.ndarray]:
        """The weights a checkpoint saves as the model's: the ones every rank agrees on."""

    def state_dict(self, engine: Engine) -> dict[str, np.ndarray]:
        """Shared state for the run's checkpoint (identical on every rank)."""

    def save_rank_state(self, root: Path, step: int, engine: Engine, keep: int) -> None:
        """State that is this rank's own, written by every rank beside the run."""

    def load_state_dict(self, shared: dict[str, np.ndarray] | None, root: Path, step: int, engine: Engine,
                        optimizer_step: int) -> list[Decision]:
        """After the engine holds the checkpoint's weights on every rank (collective); `shared`
        None: a fresh run, starting from the weights every rank now holds."""

    def close(self) -> None: ...


def share_state(world: World, engine: Engine, root: int = 0) -> None:
    """Make weights, the rest of the model's state (buffers), moments and the update count on
    every rank equal `root`'s: at the start
    of a run (a model initialised without a seed differs per rank), after a restore, and to
    repair drift."""
    if world.size == 1:
        return
    mine = world.rank == root  # only the root's are read (ZeRO-3's other ranks hold none)
    opt, opt_step = engine.get_optimizer_state() if mine else ({}, None)
    weights = world.broadcast_arrays(engine.get_weights() if mine else {}, root)
    opt = world.broadcast_arrays(opt, root)
    state = world.broadcast_arrays(engine.get_state() if mine else {}, root)
    engine.set_weights(weights)
    engine.set_optimizer_state(opt, world.bcast(opt_step, root))
    engine.set_state(state)


def make_strategy(cfg: Config, world: World, engine: Engine, reducer, hosts: list[str]) -> SyncStrategy:
    if cfg.dist.shard == "weights":
        from .fully_sharded import FullyShardedDataParallel

        return FullyShardedDataParallel(cfg, world, engine, hosts)
    if cfg.dist.shard in ("optimizer", "gradients"):  # "auto" is resolved before (resolve_shard)
        from .sharded import ShardedDataParallel

        return ShardedDataParallel(cfg, world, engine, hosts)
    if cfg.dist.mode == "diloco":
        from .diloco_strategy import DiLoCoStrategy

        return DiLoCoStrategy(cfg, world, engine, hosts)
    from .data_parallel import DataParallel

    return DataParallel(world, reducer, hosts)
