"""What joins an engine to the ranks: the world its backend needs and its gradient reducer.

The composition root's job, not the engine's (an engine knows no ranks) nor the transport's
(it knows no engines): the loop asks here by the CLI's engine name and never branches on it.
"""

from __future__ import annotations

from ..cluster.world import World, init_world, resolve_backend
from ..config import Config, ConfigError
from ..sync.compressed import QUANTIZED_WIRES, CompressedGradSync, MlxArrays, TorchArrays


def make_world(name: str, cfg: Config, device: str = "auto") -> World:
    """The ranks of this job. MPI is initialised in the order the backend needs; the torch
    engine's data plane is mpi4py (numpy buffers), whatever device its tensors live on."""
    if name == "torch":
        if cfg.dist.backend not in ("auto", "mpi4py"):
            raise ConfigError(f"dist.backend={cfg.dist.backend}: the torch engine sums its gradients over mpi4py; "
                              "use dist.backend=auto (or mpi4py)")
        return init_world("mpi4py")
    return init_world(resolve_backend(cfg.dist.backend))


def make_reducer(name: str, cfg: Config, world: World):
    """The data-plane sum of this engine's gradient arrays across ranks (`sync/grad.py`'s
    `all_sum` contract); the data-parallel strategy holds it and never asks which it is."""
    if world.size > 1 and cfg.dist.wire_dtype in QUANTIZED_WIRES:
        return CompressedGradSync.over(world, cfg.dist, TorchArrays() if name == "torch" else MlxArrays())
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
