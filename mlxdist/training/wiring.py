"""What joins an engine to the ranks: the world its backend needs and its gradient reducer.

The composition root's job, not the engine's (an engine knows no ranks) nor the transport's
(it knows no engines): the loop asks here by the CLI's engine name and never branches on it.
"""

from __future__ import annotations

from ..cluster.codec import make_codec
from ..cluster.transport import Transport, make_transport
from ..cluster.world import World, init_world, resolve_backend
from ..config import Config, ConfigError
from ..sync.compressed import CompressedGradSync, MlxArrays, TorchArrays


def make_world(name: str, cfg: Config, device: str = "auto") -> World:
    """The ranks of this job. MPI is initialised in the order the backend needs; the torch
    engine's data plane is mpi4py (numpy buffers), whatever device its tensors live on."""
    if name == "torch":
        if cfg.dist.backend not in ("auto", "mpi4py"):
            raise ConfigError(f"dist.backend={cfg.dist.backend}: the torch engine sums its gradients over mpi4py; "
                              "use dist.backend=auto (or mpi4py)")
        return init_world("mpi4py")
    return init_world(resolve_backend(cfg.dist.backend))


def make_data_plane(name: str, cfg: Config, world: World) -> Transport:
    """The run's transport (collective: every rank builds it at the same point); the torch
    engine's is mpi4py (`make_world` refuses the others)."""
    backend = "mpi4py" if name == "torch" else resolve_backend(cfg.dist.backend)
    return make_transport(world, backend, cfg.dist.ring_connections)


def make_reducer(name: str, cfg: Config, transport: Transport, wire: str):
    """The data-plane sum of this engine's gradient arrays across ranks (`sync/grad.py`'s
    `all_sum` contract) over `transport`, `wire` the run plan's gradient wire; the data-parallel
    strategy holds it and never asks which it is."""
    if transport.size > 1 and not make_codec(wire, "dist.wire_dtype").summable:
        return CompressedGradSync.over(transport, wire, cfg.dist.bucket_mb,
                                       TorchArrays() if name == "torch" else MlxArrays())
    if transport.size > 1 and name == "torch":
        from ..sync.torch_grad import TorchGradSync

        return TorchGradSync(transport, cfg.dist.bucket_mb, wire, cfg.dist.overlap)
    if transport.size > 1:
        from ..sync.grad import GradSync

        return GradSync(transport, cfg.dist.bucket_mb, wire)
    from ..sync.reducer import Unreduced

    return Unreduced()
