"""Engines do the math of one rank's step; the loop in train.py is shared by both.

This package is the only place that knows which engines exist: `train.py` asks it for a
world and an engine by the CLI's name and never branches on that name itself.
"""

from __future__ import annotations

import os

from ..config import Config
from ..dist.world import World, init_world, launched_by_mpirun, resolve_backend
from .base import Engine, StepStats

ENGINES = ("mlx", "torch")


def prepare_process(name: str) -> None:
    """Before anything imports MLX: the MLX engine on Linux re-execs with OpenBLAS preloaded."""
    if name == "mlx":
        from ..blas import ensure_openblas

        ensure_openblas()


def make_world(name: str, cfg: Config, device: str = "auto") -> World:
    """The ranks of this job. The PyTorch engine is single-node and refuses an mpirun launch
    before touching MPI; the MLX engine initialises MPI in the order its backend needs."""
    if name == "torch":
        if launched_by_mpirun():
            from .torch_engine import check_single_node

            check_single_node(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")), device)
        return World()
    return init_world(resolve_backend(cfg.dist.backend))


def make_engine(name: str, cfg: Config, world: World | None = None, device: str = "auto") -> Engine:
    """Build the engine the CLI asked for, with its model and its view of the other ranks;
    each import is lazy so neither framework is required."""
    world = world or World()
    if name == "mlx":
        from ..dist.collective import make_collective
        from ..models.build import build_mlx
        from .mlx_engine import MLXEngine

        collective = make_collective(world, resolve_backend(cfg.dist.backend), cfg.dist.ring_connections)
        return MLXEngine(build_mlx(cfg), cfg, world, collective)
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(cfg, device)
    raise ValueError(f"unknown engine '{name}' (use {' or '.join(ENGINES)})")


__all__ = ["ENGINES", "Engine", "StepStats", "make_engine", "make_world", "prepare_process"]
