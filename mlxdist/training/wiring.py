"""What joins an engine to the ranks: the world its backend needs and its gradient reducer.

The composition root's job, not the engine's (an engine knows no ranks) nor the transport's
(it knows no engines): the loop asks here by the CLI's engine name and never branches on it.
"""

from __future__ import annotations

from ..cluster.codec import make_codec
from ..cluster.transport import Transport, make_transport
from ..cluster.world import World, init_world, resolve_backend
from ..config import Config, ConfigError
from ..engine.registry import engine_spec
from ..sync.compressed import CompressedGradSync


def make_world(name: str, cfg: Config, device: str = "auto") -> World:
    """The ranks of this job. MPI is initialised in the order the backend needs."""
    return init_world(_backend(name, cfg))


def make_data_plane(name: str, cfg: Config, world: World) -> Transport:
    """The run's transport (collective: every rank builds it at the same point)."""
    return make_transport(world, _backend(name, cfg), cfg.dist.ring_connections)


def _backend(name: str, cfg: Config) -> str:
    """`dist.backend` resolved; an engine that sums over named backends only (torch: mpi4py,
    numpy buffers, whatever device its tensors live on) refuses the others."""
    backends = engine_spec(name).backends
    if not backends:
        return resolve_backend(cfg.dist.backend)
    if cfg.dist.backend not in ("auto", *backends):
        ways = " or ".join(backends)
        raise ConfigError(f"dist.backend={cfg.dist.backend}: the {name} engine sums its gradients over {ways}; "
                          f"use dist.backend=auto (or {ways})")
    return cfg.dist.backend if cfg.dist.backend in backends else backends[0]


def make_reducer(name: str, cfg: Config, transport: Transport, wire: str):
    """The data-plane sum of this engine's gradient arrays across ranks (`sync/grad.py`'s
    `all_sum` contract) over `transport`, `wire` the run plan's gradient wire; the data-parallel
    strategy holds it and never asks which it is. The engine's spec names its reducer and how
    the compressed wire reads its arrays."""
    spec = engine_spec(name)
    if transport.size > 1 and not make_codec(wire, "dist.wire_dtype").summable:
        return CompressedGradSync.over(transport, wire, cfg.dist.bucket_mb, spec.load("arrays")())
    if transport.size > 1:
        return spec.load("reducer")(transport, cfg.dist, wire)
    from ..sync.reducer import Unreduced

    return Unreduced()
