"""The parts of a checkpoint that are not a component's own: the model as the run saves it,
and the cluster it was saved on. The checkpointer gathers them by name with the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster.world import World
from ..engine.base import Engine
from ..sync.strategy import Strategy
from ..tasks import Task, TaskError


class ModelState:
    """Weights as the sync strategy names the model's (the ones every rank agrees on), the
    optimizer's moments and update count, the strategy's shared arrays, and the pretrained
    base they were trained on (a LoRA checkpoint holds no base weights)."""

    def __init__(self, engine: Engine, sync: Strategy):
        self.engine, self.sync = engine, sync

    def state_dict(self) -> dict[str, Any]:
        opt, opt_step = self.engine.get_optimizer_state()
        caps = self.engine.capabilities
        base = caps.base
        # The model's whole state: what every rank agrees on, plus buffers (equal on all ranks).
        model = self.sync.model_weights(self.engine) | self.engine.model_state.get_state()
        return {"model": model, "optimizer": opt, "optimizer_step": opt_step,
                "sync": self.sync.state_dict(self.engine), "engine": self.engine.name,
                "base_fingerprint": caps.base_fingerprint, "base_files": dict(base.files) if base else {}}


@dataclass
class ClusterInfo:
    """Who saved the checkpoint, so a resume can tell the same cluster from another."""

    world_size: int
    hosts: list[str]
    config: dict = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "hosts": self.hosts, "config": self.config}


_RANKS = "ranks"  # how many ranks saved it (no '/': not a rank's key)


class TaskState:
    """What a task carries between steps (`Task.state_dict`): each rank's own, all of them in
    the checkpoint (`task.safetensors`, `rank<r>/<key>`), each rank's handed back to it on a
    resume with as many ranks. Nested dicts are kept; values come back as numpy arrays."""

    collective = True  # every rank's state travels to the writers

    def __init__(self, task: Task, world: World):
        self.task, self.world = task, world

    def state_dict(self) -> dict[str, Any]:
        mine = _flat_arrays(self.task.state_dict(), f"task {self.task.name}: state_dict()")
        gathered = self.world.allgather(mine)
        arrays = {f"rank{r}/{k}": v for r, d in enumerate(gathered) for k, v in d.items()}
        return {"task": arrays | {_RANKS: np.array(self.world.size)}}

    def load(self, saved: dict[str, np.ndarray] | None) -> str | None:
        """Rank 0's read of the checkpoint -> each rank's own state. Returns a note when the
        checkpoint's ranks do not match this run's (the task then starts its state afresh)."""
        saved = self.world.bcast(saved if self.world.is_main else None)
        if saved is None:
            return None
        if _RANKS not in saved:
            return (f"task {self.task.name}: the checkpoint holds no carried state (saved before the task had "
                    "state_dict): it starts afresh")
        ranks = int(saved[_RANKS])
        if ranks != self.world.size:
            return (f"task {self.task.name}: its carried state was saved by {ranks} rank(s), this run has "
                    f"{self.world.size}: each rank's state starts afresh (load_state_dict not called)")
        prefix = f"rank{self.world.rank}/"
        flat = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        try:
            self.task.load_state_dict(_nested(flat))
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
            raise TaskError(f"task {self.task.name}: load_state_dict raised {type(e).__name__}: {e}") from None
        return None


def _flat_arrays(tree: Any, where: str, prefix: str = "") -> dict[str, np.ndarray]:
    if not isinstance(tree, dict):
        raise TaskError(f"{where} returned {type(tree).__name__}{' at ' + prefix.rstrip('/') if prefix else ''}, "
                        "not a dict of arrays, tensors and numbers")
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flat_arrays(value, where, name + "/")
            continue
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().float().cpu().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
        array = np.asarray(value)
        if array.dtype == object or array.dtype.kind in "USV":
            raise TaskError(f"{where}: '{name}' is a {type(value).__name__}; keep arrays, tensors and numbers there")
        out[name] = array
    return out


def _nested(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *path, leaf = key.split("/")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree
