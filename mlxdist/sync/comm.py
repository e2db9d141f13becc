"""Numpy-facing collectives for DiLoCo's outer step, over the job's real transports.

`DiLoCo.outer_step` takes plain callables so its arithmetic stays framework-free; these
adapt the data-plane `Collective` (MLX arrays) and the control-plane mpi4py
communicator to them. The all-gather carries the lossy wire formats: byte payloads of
the same size on every rank, which MPI moves without pickling.
"""

from __future__ import annotations

import numpy as np

from .diloco import AllGather, AllReduceSum


def allreduce_from_collective(collective) -> AllReduceSum:
    """`collective` is an mlxdist.cluster.collective.Collective; results come back as fp32 numpy."""
    import mlx.core as mx

    def allreduce_sum(arrays: list[np.ndarray]) -> list[np.ndarray]:
        out = collective.all_sum([mx.array(np.ascontiguousarray(a)) for a in arrays])
        mx.eval(out)
        return [np.array(o) for o in out]

    return allreduce_sum


def allreduce_from_comm(comm) -> AllReduceSum:
    """Sums over an mpi4py communicator with the project's ring all-reduce: the same
    bits on every rank, and no MLX, so it can run on a background thread (give it its
    own `comm.Dup()` there, so its messages never meet the training loop's)."""
    from ..cluster.ring import ring_allreduce

    def allreduce_sum(arrays: list[np.ndarray]) -> list[np.ndarray]:
        srcs = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        if comm is None or comm.Get_size() == 1:
            return [a.copy() for a in srcs]
        outs = [np.empty_like(a) for a in srcs]
        ring_allreduce(comm, srcs, outs)
        return outs

    return allreduce_sum


def allgather_from_comm(comm) -> AllGather:
    """`comm` is an mpi4py communicator (World.comm), or None for a single process. The
    arrays returned are views of a buffer the next call overwrites."""

    received: dict[int, np.ndarray] = {}  # by payload size: reused, valid until the next call

    def allgather(payload: np.ndarray) -> list[np.ndarray]:
        buf = np.ascontiguousarray(payload, np.uint8)
        if comm is None:
            return [buf.copy()]
        out = received.get(buf.size)
        if out is None:
            out = received[buf.size] = np.empty(comm.Get_size() * buf.size, np.uint8)
        comm.Allgather(buf, out)
        return list(out.reshape(comm.Get_size(), buf.size))

    return allgather
