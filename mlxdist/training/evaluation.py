"""Held-out loss, on the same samples whatever the cluster layout, so evaluations taken
before and after a re-split, an OOM shrink or a resume stay comparable."""

from __future__ import annotations

from ..cluster.world import World
from ..config import TrainConfig
from ..control.split import micro_batches
from ..data.sampler import EVAL, StreamIndices
from ..engine.base import Engine
from ..sync.strategy import Strategy
from ..tasks import Task
from ..tasks.metrics import MetricSums, means


class Evaluator:
    """The task's `eval_dataset`, weighted like training: summed loss over summed units."""

    def __init__(self, task: Task, cfg: TrainConfig, world: World):
        self.task, self.cfg, self.world = task, cfg, world

    def due(self, step: int, last: bool) -> bool:
        return (self.task.eval_dataset is not None and bool(self.cfg.eval_every)
                and (step % self.cfg.eval_every == 0 or last))

    def run(self, engine: Engine, micro: int, sync: Strategy) -> tuple[float, dict[str, float]]:
        """Mean loss per unit and the task's metrics; eval batches are dealt round-robin to
        the ranks, and computed as the sync strategy computes them (ZeRO-3: stage by stage,
        every rank in every gather)."""
        data = self.task.eval_dataset
        metrics = MetricSums()
        b, n = self.cfg.batch_size, len(data)
        batches = self.cfg.eval_batches or -(-n // b)  # 0: the whole set, each sample once
        mine = []
        for i in range(self.world.rank, batches, self.world.size):
            idx = [(i * b + j) % n for j in range(b)] if self.cfg.eval_batches else list(range(i * b, min(n, i * b + b)))
            idx = StreamIndices(idx, range(i * b, i * b + len(idx)), self.cfg.seed, EVAL)  # window slots: augment keys
            offset = 0
            for size in micro_batches(len(idx), micro):
                mine.append(self.task.make_batch(data, idx[offset : offset + size]))
                offset += size
        losses = sync.eval_losses(engine, mine, metrics)
        loss_sum, units = sum(ls for ls, _ in losses), sum(c for _, c in losses)
        # Every rank sums the same names, also one that got no eval batch (its first micro-batch
        # would have named them): the names come from rank 0.
        names = self.world.bcast(metrics.names())
        loss_sum, units, *flat = self.world.allreduce_sum([loss_sum, units, *metrics.flat(units, names)])
        return loss_sum / max(units, 1), means(names, flat)
