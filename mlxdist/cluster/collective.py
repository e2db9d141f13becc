"""Data-plane collectives on MLX arrays: sum-all-reduce and broadcast.

Three transports behind one small interface, chosen by `dist.backend`:
- `mpi4py`: arrays become numpy buffers; large ones go through our own pipelined ring
  all-reduce over MPI point-to-point messages, small ones through Open MPI's Allreduce;
- `mlx-mpi`: `mx.distributed` with its MPI backend;
- `mlx-ring`: `mx.distributed` with its TCP ring backend, bootstrapped over mpi4py.
`auto` picks mpi4py: with the ring it measured fastest on loopback and between hosts
on shaped links (`python -m mlxdist.bench allreduce`; see docs/performance.md, "Choosing a backend").
The ring itself, and why it is ours, is in `ring.py` (numpy only).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import mlx.core as mx
import numpy as np

from .ring import RING_MIN_BYTES, NumpyAllReduce, ring_allreduce  # noqa: F401 (re-exported)
from .world import World, resolve_backend  # noqa: F401 (re-exported)


def _to_numpy(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated MLX array (bfloat16 as its uint16 bits)."""
    if a.dtype == mx.bfloat16:
        return np.asarray(a.view(mx.uint16)).reshape(-1)
    return np.asarray(a).reshape(-1)


def _from_numpy(b: np.ndarray, like: mx.array) -> mx.array:
    out = mx.array(b)
    if like.dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out.reshape(like.shape)


class Collective:
    name = "single"
    rank, size = 0, 1
    # Whether large arrays go out as they are, without GradSync packing them first:
    # a pack is a full copy of the gradients, which the mpi4py ring does not need.
    direct_min_bytes: int | None = None

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        return arrays

    def broadcast(self, arrays: list[mx.array], root: int = 0) -> list[mx.array]:
        return arrays


class Mpi4pyCollective(NumpyAllReduce, Collective):
    name = "mpi4py"
    direct_min_bytes = RING_MIN_BYTES

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        mx.eval(arrays)
        srcs = [_to_numpy(a) for a in arrays]
        outs = self.sum_buffers(srcs)
        return [_from_numpy(b, a) for a, b in zip(arrays, outs, strict=True)]

    def broadcast(self, arrays: list[mx.array], root: int = 0) -> list[mx.array]:
        mx.eval(arrays)
        bufs = [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, copy=True) for a in arrays]
        with self.world.watch("weight broadcast"):
            for b in bufs:
                self.comm.Bcast(b, root=root)
        return [mx.array(b).astype(a.dtype) for a, b in zip(arrays, bufs, strict=True)]


class MLXCollective(Collective):
    def __init__(self, world: World, group, name: str):
        self.world, self.group, self.name = world, group, name
        self.rank, self.size = group.rank(), group.size()

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        out = [mx.distributed.all_sum(a, group=self.group) for a in arrays]
        with self.world.watch("gradient all-reduce"):
            mx.eval(out)
        return out

    def broadcast(self, arrays: list[mx.array], root: int = 0) -> list[mx.array]:
        # mx.distributed has no broadcast: a sum where only the root contributes is one.
        keep = self.rank == root
        out = [mx.distributed.all_sum(a if keep else mx.zeros_like(a), group=self.group) for a in arrays]
        with self.world.watch("weight broadcast"):
            mx.eval(out)
        return out


def _my_address(world: World) -> str:
    """The address peers can reach this rank on: the one the OS would route to rank 0's host."""
    host0 = world.bcast(socket.gethostname())
    try:
        target = socket.gethostbyname(host0)
    except OSError:
        target = "127.0.0.1"
    if world.size > 1 and target.startswith("127.") and host0 != socket.gethostname():
        target = "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((target, 9))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def _ring_group(world: World, connections: int):
    """Bootstrap MLX's ring: every rank binds ports, all ranks all-gather them, MLX connects."""
    ip = os.environ.get("MLXDIST_RING_IP") or _my_address(world)
    ports = []
    for _ in range(connections):
        s = socket.socket()
        s.bind((ip, 0))
        ports.append(s.getsockname()[1])
        s.close()
    table = world.allgather([f"{ip}:{p}" for p in ports])
    fd, path = tempfile.mkstemp(prefix=f"mlxdist-ring-{world.rank}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f)
    os.environ["MLX_RANK"] = str(world.rank)
    os.environ["MLX_HOSTFILE"] = path
    with world.watch("ring backend connect"):
        group = mx.distributed.init(strict=True, backend="ring")
    os.unlink(path)
    return group


def make_collective(world: World, backend: str, ring_connections: int = 1) -> Collective:
    if world.size == 1:
        return Collective()
    if backend == "mpi4py":
        return Mpi4pyCollective(world)
    if backend == "mlx-mpi":
        return MLXCollective(world, mx.distributed.init(strict=True, backend="mpi"), "mlx-mpi")
    if backend == "mlx-ring":
        return MLXCollective(world, _ring_group(world, ring_connections), "mlx-ring")
    if backend == "mlx-jaccl":
        from . import jaccl

        group = jaccl.bootstrap(world, _my_address(world), os.environ.get("MLXDIST_MLX_HOSTFILE"))
        return MLXCollective(world, group, "mlx-jaccl")
    raise ValueError(f"dist.backend: unknown backend '{backend}'")
