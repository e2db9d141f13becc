"""Held-out loss, on the same windows whatever the cluster layout, so evaluations taken
before and after a re-split, an OOM shrink or a resume stay comparable."""

from __future__ import annotations

from ..config import TrainConfig
from ..control.split import micro_batches
from ..data.batch import TokenBatch
from ..data.datasets import Dataset
from ..dist.world import World
from ..engine.base import Engine


class Evaluator:
    def __init__(self, eval_set: Dataset, cfg: TrainConfig, world: World):
        self.eval_set, self.cfg, self.world = eval_set, cfg, world

    def due(self, step: int, last: bool) -> bool:
        return bool(self.cfg.eval_every) and (step % self.cfg.eval_every == 0 or last)

    def run(self, engine: Engine, micro: int) -> float:
        """Mean loss per trained token; eval batches are dealt round-robin to the ranks."""
        loss_sum = tokens = 0.0
        b, n = self.cfg.batch_size, len(self.eval_set)
        for i in range(self.world.rank, self.cfg.eval_batches, self.world.size):
            idx = [(i * b + j) % n for j in range(b)]
            offset = 0
            for size in micro_batches(b, micro):
                ls, count = engine.eval_loss(TokenBatch.of(self.eval_set.batch(idx[offset : offset + size])))
                loss_sum, tokens, offset = loss_sum + ls, tokens + count, offset + size
        loss_sum, tokens = self.world.allreduce_sum([loss_sum, tokens])
        return loss_sum / max(tokens, 1)
