"""Numpy-facing collectives for DiLoCo's outer step, over the run's transport.

`DiLoCo.outer_step` takes plain callables so its arithmetic stays framework-free; these
adapt a `cluster.transport.Transport` to them (the run's, or a `channel()` of it for the
overlap thread, so its messages never meet the training loop's). The all-gather carries
the lossy wire formats: byte payloads of the same size on every rank.
"""

from __future__ import annotations

import numpy as np

from ..cluster.transport import Transport
from .diloco import AllGather, AllReduceSum


def allreduce_from_transport(transport: Transport) -> AllReduceSum:
    """Flat fp32 sums with the same bits on every rank (DiLoCo's anchors have no drift check
    to repair a difference), in fresh buffers: a sync's results outlive the next one's."""

    def allreduce_sum(arrays: list[np.ndarray]) -> list[np.ndarray]:
        srcs = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        return transport.all_sum(srcs, "outer all-reduce", identical=True)

    return allreduce_sum


def allgather_from_transport(transport: Transport) -> AllGather:
    """The arrays returned are views of a buffer the next call overwrites."""
    return transport.all_gather_bytes
