"""Gradient sum across ranks for the PyTorch engine: torch.distributed has no MPS backend,
so tensors are packed into flat buckets on their device, copied to host numpy once per
bucket and summed by the transport (`cluster/transport.py`, the same ring as MLX's over mpi4py),
then copied back.

Overlap, as DDP does it: armed before a step's last backward, each bucket is packed and
handed to a sender thread as soon as backward has finished all its gradients (post-
accumulate-grad hooks), while backward goes on with earlier layers. Buckets go out strictly
in bucket order, so every rank issues the same collectives in the same order, on a
transport channel of their own (the loop's control messages never interleave with them).
`dist.bucket_mb` sizes buckets; `dist.wire_dtype=bfloat16` halves the bytes (`cluster/codec.py`;
the sum comes back as fp32). Knows tensors, not layers.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cluster.codec import make_codec
from ..cluster.transport import Transport
from .reducer import Reducer, SyncStats, plan_buckets

if TYPE_CHECKING:
    from ..engine.base import GradientFeed


class TorchGradSync(Reducer):
    @classmethod
    def configured(cls, transport: Transport, dist, wire_dtype: str) -> TorchGradSync:
        """As the run's `dist` config asks (the engine registry's `reducer`)."""
        return cls(transport, dist.bucket_mb, wire_dtype, dist.overlap)

    def __init__(self, transport: Transport, bucket_mb: float = 25.0, wire_dtype: str = "float32",
                 overlap: bool = True):
        if wire_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dist.wire_dtype={wire_dtype}: the torch engine sums float32 or bfloat16 on the wire")
        self.transport, self.overlap = transport, overlap
        self.bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        self.codec = make_codec(wire_dtype, "dist.wire_dtype", summable=True)
        self._plan: list[list[int]] | None = None
        self._sender = _Sender(transport.channel()) if overlap else None  # collective: every rank builds it
        self._ready: set[int] = set()
        self._next = 0
        self._gradients: GradientFeed | None = None
        self.overlapped = 0  # buckets of this step that went out before backward ended

    # -- the plan -----------------------------------------------------------------------
    def _make_plan(self, sizes: list[int], order: list[int]) -> None:
        self._plan = [[order[j] for j in b] for b in plan_buckets([sizes[i] for i in order], self.bucket_elems)]
        self._bucket_of = {i: k for k, b in enumerate(self._plan) for i in b}

    def _pack(self, tensors: list[torch.Tensor]) -> np.ndarray:
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        return self.codec.to_wire(flat.cpu().numpy())

    # -- overlap ------------------------------------------------------------------------
    def arm(self, gradients: GradientFeed) -> None:
        """Before the step's last backward: send buckets as their gradients become final."""
        if self._sender is None:
            return
        if self._plan is None:
            self._make_plan(gradients.gradient_sizes(), gradients.backward_order())
        self._ready = set()  # a retry after out-of-memory: earlier readiness no longer holds
        self._gradients = gradients
        gradients.on_gradient_ready(self._gradient_ready)

    def _gradient_ready(self, i: int) -> None:
        self._ready.add(i)
        while self._next < len(self._plan) and all(j in self._ready for j in self._plan[self._next]):
            self._launch(self._next, [self._gradients.gradient(j) for j in self._plan[self._next]])
            self.overlapped += 1

    def _launch(self, k: int, tensors: list[torch.Tensor]) -> None:
        self._sender.send(k, self._pack(tensors))
        self._next = k + 1

    # -- the sum ------------------------------------------------------------------------
    def all_sum(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], SyncStats]:
        if self._plan is None:
            self._make_plan([t.numel() for t in tensors], list(range(len(tensors))))
        t0 = time.perf_counter()
        overlapped, self.overlapped = self.overlapped, 0
        if self._sender is not None:
            for k in range(self._next, len(self._plan)):  # buckets backward did not finish (unused params)
                self._launch(k, [tensors[i] for i in self._plan[k]])
            with self.transport.watch("gradient all-reduce"):
                summed, nbytes = self._sender.collect(len(self._plan))
            self._ready, self._next = set(), 0
        else:
            bufs = [self._pack([tensors[i] for i in b]) for b in self._plan]
            summed, nbytes = self.transport.all_sum(bufs, reuse=True), sum(b.nbytes for b in bufs)
        stats = SyncStats(time.perf_counter() - t0, nbytes, overlapped)
        out: list[torch.Tensor] = list(tensors)
        for bucket, buf in zip(self._plan, summed, strict=True):
            buf = self.codec.from_wire(buf)  # fp32: no copy
            # No copy on a CPU rank: the update reads these before the next step's sum reuses the buffer.
            total = torch.from_numpy(buf).to(tensors[bucket[0]].device)
            offset = 0
            for i in bucket:
                n = tensors[i].numel()
                out[i] = total[offset : offset + n].view(tensors[i].shape)
                offset += n
        return out, stats


class _Sender:
    """One thread that sums buckets in the order they were handed over, on a transport channel
    only it uses (MPI is initialised thread-multiple by mpi4py)."""

    def __init__(self, channel: Transport):
        self.channel = channel
        self.todo: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="grad-sender").start()

    def send(self, k: int, buf: np.ndarray) -> None:
        self.todo.put((k, buf))

    def collect(self, n: int) -> tuple[list[np.ndarray], int]:
        got: dict[int, np.ndarray] = {}
        nbytes = 0
        while len(got) < n:
            k, out, err = self.done.get()
            if err is not None:
                raise err
            got[k] = out
            nbytes += out.nbytes
        return [got[k] for k in range(n)], nbytes

    def _run(self) -> None:
        while True:
            k, buf = self.todo.get()
            try:
                self.done.put((k, self.channel.all_sum([buf])[0], None))
            except Exception as e:  # noqa: BLE001 - handed to the loop's thread
                self.done.put((k, None, e))
