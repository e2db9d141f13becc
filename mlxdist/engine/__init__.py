"""Engines do the math of one rank's step; the loop in training/loop.py is shared by both.

This package knows which engines exist and builds one by the CLI's name; it knows no ranks
(no `cluster`, no `sync`: checked by the import contracts in pyproject.toml). What joins an
engine to the ranks (the world its backend needs, its gradient reducer) is
`training/wiring.py`'s.
"""

from __future__ import annotations

from ..config import Config
from ..tasks import Task
from .base import Engine, LocalGradients, StepStats, local_step
from .registry import ENGINES, EngineSpec, engine_spec


def prepare_process(name: str) -> None:
    """Before anything imports MLX: the MLX engine on Linux re-execs with OpenBLAS preloaded.
    An unknown name is `make_engine`'s to refuse."""
    spec = ENGINES.get(name)
    if spec is not None and spec.openblas:
        from ..blas import ensure_openblas

        ensure_openblas()


def make_engine(name: str, cfg: Config, device: str = "auto", task: Task | None = None,
                local_rank: int = 0, micro_batch: int = 0) -> Engine:
    """Build the engine the CLI asked for, with the task's model (default: the built-in LM);
    each import is lazy so neither framework is required. `local_rank` picks this rank's GPU
    where a host has several (torch, `--device auto`)."""
    return engine_spec(name).load("make")(cfg, device, task, local_rank, micro_batch)


__all__ = ["ENGINES", "Engine", "EngineSpec", "LocalGradients", "StepStats", "engine_spec", "local_step", "make_engine",
           "prepare_process"]
