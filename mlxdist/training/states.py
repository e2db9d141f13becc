"""The parts of a checkpoint that are not a component's own: the model as the run saves it,
and the cluster it was saved on. The checkpointer gathers them by name with the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.base import Engine
from ..sync.strategy import SyncStrategy


class ModelState:
    """Weights as the sync strategy names the model's (the ones every rank agrees on), the
    optimizer's moments and update count, the strategy's shared arrays, and the pretrained
    base they were trained on (a LoRA checkpoint holds no base weights)."""

    def __init__(self, engine: Engine, sync: SyncStrategy):
        self.engine, self.sync = engine, sync

    def state_dict(self) -> dict[str, Any]:
        opt, opt_step = self.engine.get_optimizer_state()
        base = self.engine.base
        # The model's whole state: what every rank agrees on, plus buffers (equal on all ranks).
        model = self.sync.model_weights(self.engine) | self.engine.get_state()
        return {"model": model, "optimizer": opt, "optimizer_step": opt_step,
                "sync": self.sync.state_dict(self.engine), "engine": self.engine.name,
                "base_fingerprint": self.engine.base_fingerprint, "base_files": dict(base.files) if base else {}}


@dataclass
class ClusterInfo:
    """Who saved the checkpoint, so a resume can tell the same cluster from another."""

    world_size: int
    hosts: list[str]
    config: dict = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "hosts": self.hosts, "config": self.config}
