"""Engines do the math of one rank's step; the loop in training/loop.py is shared by both.

This package is the only place that knows which engines exist: the loop asks it for a
world, an engine and the engine's gradient reducer by the CLI's name and never branches
on that name itself.
"""

from __future__ import annotations

from ..cluster.world import World, init_world, resolve_backend
from ..config import Config, ConfigError
from ..tasks import Task
from .base import Engine, LocalGradients, StepStats, local_step

ENGINES = ("mlx", "torch")


def prepare_process(name: str) -> None:
    """Before anything imports MLX: the MLX engine on Linux re-execs with OpenBLAS preloaded."""
    if name == "mlx":
        from ..blas import ensure_openblas

        ensure_openblas()


def make_world(name: str, cfg: Config, device: str = "auto") -> World:
    """The ranks of this job. MPI is initialised in the order the backend needs; the torch
    engine's data plane is mpi4py (numpy buffers), whatever device its tensors live on."""
    if name == "torch":
        if cfg.dist.backend not in ("auto", "mpi4py"):
            raise ConfigError(f"dist.backend={cfg.dist.backend}: the torch engine sums its gradients over mpi4py; "
                              "use dist.backend=auto (or mpi4py)")
        return init_world("mpi4py")
    return init_world(resolve_backend(cfg.dist.backend))


def make_engine(name: str, cfg: Config, device: str = "auto", task: Task | None = None,
                local_rank: int = 0, micro_batch: int = 0) -> Engine:
    """Build the engine the CLI asked for, with the task's model (default: the built-in LM);
    each import is lazy so neither framework is required. `local_rank` picks this rank's GPU
    where a host has several (torch, `--device auto`)."""
    if name == "mlx":
        from .mlx_engine import MLXEngine

        return MLXEngine(cfg, task, micro_batch=micro_batch)
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(cfg, device, task=task, local_rank=local_rank, micro_batch=micro_batch)
    raise ValueError(f"unknown engine '{name}' (use {' or '.join(ENGINES)})")


def make_reducer(name: str, cfg: Config, world: World):
    """The data-plane sum of this engine's gradient arrays across ranks (`sync/grad.py`'s
    `all_sum` contract); the data-parallel strategy holds it and never asks which it is."""
    if world.size > 1 and name == "torch":
        from ..sync.torch_grad import TorchGradSync

        return TorchGradSync(world, cfg.dist.bucket_mb, cfg.dist.wire_dtype, cfg.dist.overlap)
    if world.size > 1:
        from ..cluster.collective import make_collective
        from ..sync.grad import GradSync

        collective = make_collective(world, resolve_backend(cfg.dist.backend), cfg.dist.ring_connections)
        return GradSync(collective, cfg.dist.bucket_mb, cfg.dist.wire_dtype)
    from ..sync.reducer import Unreduced

    return Unreduced()


__all__ = ["ENGINES", "Engine", "LocalGradients", "StepStats", "local_step", "make_engine", "make_reducer",
           "make_world", "prepare_process"]
