"""Gradient sum across ranks for the PyTorch engine: torch.distributed has no MPS backend,
so tensors are packed into flat buckets on their device, copied to host numpy once per
bucket and summed over mpi4py (`cluster/ring.py`, the same ring as MLX's), then copied back.

Overlap, as DDP does it: armed before a step's last backward, each bucket is packed and
handed to a sender thread as soon as backward has finished all its gradients (post-
accumulate-grad hooks), while backward goes on with earlier layers. Buckets go out strictly
in bucket order, so every rank issues the same collectives in the same order, on
communicators of their own (the loop's control messages never interleave with them).
`dist.bucket_mb` sizes buckets; `dist.wire_dtype=bfloat16` halves the bytes (the sum comes
back as fp32). Knows tensors, not layers.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from ..cluster.ring import RING_MIN_BYTES, NumpyAllReduce, bf16_bits, ring_allreduce
from ..cluster.world import World
from .reducer import Reducer, SyncStats, plan_buckets


class TorchGradSync(Reducer):
    def __init__(self, world: World, bucket_mb: float = 25.0, wire_dtype: str = "float32", overlap: bool = True):
        if wire_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dist.wire_dtype={wire_dtype}: the torch engine sums float32 or bfloat16 on the wire")
        self.world, self.overlap = world, overlap
        self.summer = NumpyAllReduce(world)
        self.bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        self.bf16 = wire_dtype == "bfloat16"
        self._plan: list[list[int]] | None = None
        self._sender = _Sender(world) if overlap else None  # collective: every rank builds its reducer
        self._ready: set[int] = set()
        self._next = 0
        self._engine = None
        self.overlapped = 0  # buckets of this step that went out before backward ended

    # -- the plan -----------------------------------------------------------------------
    def _make_plan(self, sizes: list[int], order: list[int]) -> None:
        self._plan = [[order[j] for j in b] for b in plan_buckets([sizes[i] for i in order], self.bucket_elems)]
        self._bucket_of = {i: k for k, b in enumerate(self._plan) for i in b}

    def _pack(self, tensors: list[torch.Tensor]) -> np.ndarray:
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        if self.bf16:
            return bf16_bits(flat.cpu().numpy())
        return flat.cpu().numpy()

    # -- overlap ------------------------------------------------------------------------
    def arm(self, engine) -> None:
        """Before the step's last backward: send buckets as their gradients become final."""
        if self._sender is None:
            return
        if self._plan is None:
            self._make_plan(engine.gradient_sizes(), engine.backward_order())
        self._ready = set()  # a retry after out-of-memory: earlier readiness no longer holds
        self._engine = engine
        engine.on_gradient_ready(self._gradient_ready)

    def _gradient_ready(self, i: int) -> None:
        self._ready.add(i)
        while self._next < len(self._plan) and all(j in self._ready for j in self._plan[self._next]):
            self._launch(self._next, [self._engine.gradient(j) for j in self._plan[self._next]])
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
            with self.world.watch("gradient all-reduce"):
                summed, nbytes = self._sender.collect(len(self._plan))
            self._ready, self._next = set(), 0
        else:
            bufs = [self._pack([tensors[i] for i in b]) for b in self._plan]
            summed, nbytes = self.summer.sum_buffers(bufs), sum(b.nbytes for b in bufs)
        stats = SyncStats(time.perf_counter() - t0, nbytes, overlapped)
        out: list[torch.Tensor] = list(tensors)
        for bucket, buf in zip(self._plan, summed, strict=True):
            if buf.dtype == np.uint16:  # bfloat16 bits -> fp32 exactly
                buf = (buf.astype(np.uint32) << 16).view(np.float32)
            # No copy on a CPU rank: the update reads these before the next step's sum reuses the buffer.
            total = torch.from_numpy(buf).to(tensors[bucket[0]].device)
            offset = 0
            for i in bucket:
                n = tensors[i].numel()
                out[i] = total[offset : offset + n].view(tensors[i].shape)
                offset += n
        return out, stats


class _Sender:
    """One thread that sums buckets in the order they were handed over, on communicators
    only it uses (MPI is initialised thread-multiple by mpi4py)."""

    def __init__(self, world: World):
        self.comm, self.ring_comm = world.comm.Dup(), world.comm.Dup()
        self.use_ring = len(set(world.allgather(world.host))) > 1
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
        from mpi4py import MPI

        while True:
            k, buf = self.todo.get()
            try:
                if buf.dtype == np.uint16:  # MPI cannot sum bfloat16 bits: fp32 on the wire, rounded back
                    f32 = (buf.astype(np.uint32) << 16).view(np.float32)
                    self.comm.Allreduce(MPI.IN_PLACE, f32, op=MPI.SUM)
                    out = bf16_bits(f32)
                else:
                    out = np.empty_like(buf)
                    if self.use_ring and buf.nbytes >= RING_MIN_BYTES:
                        ring_allreduce(self.ring_comm, [buf], [out])
                    else:
                        self.comm.Allreduce(buf, out, op=MPI.SUM)
                self.done.put((k, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the loop's thread
                self.done.put((k, None, e))
