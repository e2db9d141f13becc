"""Gradient sum across ranks for the PyTorch engine: torch.distributed has no MPS backend,
so tensors are packed into flat buckets on their device, copied to host numpy once per
bucket and summed over mpi4py (`dist/ring.py`, the same ring as MLX's), then copied back.

Buckets follow `dist.bucket_mb` and `dist.wire_dtype` (bfloat16 halves the bytes; the sum
comes back as fp32). Knows tensors, not layers.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..dist.ring import NumpyAllReduce
from ..dist.world import World
from .reducer import SyncStats, plan_buckets


class TorchGradSync:
    def __init__(self, world: World, bucket_mb: float = 25.0, wire_dtype: str = "float32"):
        if wire_dtype == "float16":
            raise ValueError("dist.wire_dtype=float16: the torch engine sums float32 or bfloat16 on the wire")
        self.summer = NumpyAllReduce(world)
        self.bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        self.bf16 = wire_dtype == "bfloat16"
        self._plan: list[list[int]] | None = None

    def _to_host(self, flat: torch.Tensor) -> np.ndarray:
        if self.bf16:
            return flat.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        return flat.to(torch.float32).cpu().numpy()

    @staticmethod
    def _to_device(buf: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        if buf.dtype == np.uint16:  # bfloat16 bits -> fp32 exactly
            buf = (buf.astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(np.array(buf, np.float32)).to(like.device)

    def all_sum(self, tensors: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], SyncStats]:
        present = [i for i, t in enumerate(tensors) if t is not None]
        if self._plan is None:
            self._plan = [[present[j] for j in b] for b in plan_buckets([tensors[i].numel() for i in present],
                                                                          self.bucket_elems)]
        flats = [torch.cat([tensors[i].reshape(-1).to(torch.float32) for i in b]) for b in self._plan]
        bufs = [self._to_host(f) for f in flats]
        t0 = time.perf_counter()
        summed = self.summer.sum_buffers(bufs)
        stats = SyncStats(time.perf_counter() - t0, sum(b.nbytes for b in bufs))
        out: list[torch.Tensor | None] = list(tensors)
        for bucket, flat, buf in zip(self._plan, flats, summed, strict=True):
            total = self._to_device(buf, flat)
            offset = 0
            for i in bucket:
                n = tensors[i].numel()
                out[i] = total[offset : offset + n].view(tensors[i].shape)
                offset += n
        return out, stats
