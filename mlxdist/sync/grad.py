"""Gradient sync and weight agreement across ranks. Knows arrays, not layers.

Gradients are packed into flat buckets of about `bucket_mb` (few large messages beat many
small ones on Ethernet/Wi-Fi latency), optionally cast to bf16/fp16 on the wire (half the
bytes, `cluster/codec.py`; the sum is cast back to fp32), and summed across ranks by the
transport (`all_sum_arrays`: MLX arrays, no numpy round trip under mlx-* backends). Where the
transport pipelines large arrays itself (`direct_min_bytes`, the mpi4py ring) and no cast is
needed, large gradients skip the pack: on a slow-memory box the pack copy alone cost
~10% of a 1 Gbit/s link's time.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..cluster.codec import make_codec
from ..cluster.transport import Transport
from .reducer import Reducer, SyncStats, Unreduced, plan_buckets


class GradSync(Reducer):
    @classmethod
    def configured(cls, transport: Transport, dist, wire_dtype: str) -> GradSync:
        """As the run's `dist` config asks (the engine registry's `reducer`)."""
        return cls(transport, dist.bucket_mb, wire_dtype)

    def __init__(self, transport: Transport, bucket_mb: float = 25.0, wire_dtype: str = "float32"):
        self.transport = transport
        self.bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        # The codec's name is MLX's dtype name: the cast is the encoding, the ring sums it.
        self.wire = getattr(mx, make_codec(wire_dtype, "dist.wire_dtype", summable=True).name)
        self._plan: list[list[int]] | None = None
        self._layout: list[tuple] = []

    def _make_plan(self, arrays: list[mx.array]) -> list[list[int]]:
        direct = self.transport.direct_min_bytes
        if direct is None:
            return plan_buckets([a.size for a in arrays], self.bucket_elems)
        alone = [i for i, a in enumerate(arrays)
                 if a.dtype == self.wire and a.nbytes >= direct]
        rest = [i for i in range(len(arrays)) if i not in set(alone)]
        packed = plan_buckets([arrays[i].size for i in rest], self.bucket_elems)
        return [[i] for i in alone] + [[rest[j] for j in b] for b in packed]

    def forget_layout(self) -> None:
        """The next `all_sum` plans its buckets afresh (a list of other sizes or dtypes than the
        last one's is replanned anyway: a sum never cuts one layout by another's plan)."""
        self._plan = None

    def arm(self, gradients) -> None:
        """MLX builds the whole backward graph lazily: there is nothing to overlap with."""

    def all_sum(self, arrays: list[mx.array]) -> tuple[list[mx.array], SyncStats]:
        if self.transport.size == 1:
            return arrays, SyncStats()
        flats = self._pack(arrays)
        mx.eval(flats)
        t0 = time.perf_counter()
        summed = self.transport.all_sum_arrays(flats)
        mx.eval(summed)
        stats = SyncStats(time.perf_counter() - t0, sum(f.nbytes for f in flats))
        return self._unpack(summed, arrays), stats

    def all_sum_in_graph(self, arrays: list[mx.array]) -> list[mx.array]:
        """The same sum, in the same buckets, left as lazy graph nodes (no eval, no host): what
        a step under `mx.compile` may hold. The transport must declare `graph_sum`."""
        if self.transport.size == 1:
            return arrays
        return self._unpack(self.transport.all_sum_in_graph(self._pack(arrays)), arrays)

    def _pack(self, arrays: list[mx.array]) -> list[mx.array]:
        """The flat wire buckets (lazy): one array alone where the transport sends it as it is."""
        layout = [(a.size, a.dtype) for a in arrays]
        if self._plan is None or layout != self._layout:  # planned once per gradient list
            self._plan, self._layout = self._make_plan(arrays), layout
        return [arrays[b[0]].reshape(-1) if len(b) == 1 and arrays[b[0]].dtype == self.wire
                else mx.concatenate([arrays[i].reshape(-1) for i in b]).astype(self.wire)
                for b in self._plan]

    def _unpack(self, summed: list[mx.array], arrays: list[mx.array]) -> list[mx.array]:
        """The summed buckets cut back into fp32 arrays of `arrays`' shapes."""
        out: list[mx.array] = [None] * len(arrays)  # type: ignore[list-item]
        for bucket, flat in zip(self._plan, summed, strict=True):
            flat = flat.astype(mx.float32)
            if len(bucket) == 1:
                out[bucket[0]] = flat.reshape(arrays[bucket[0]].shape)
                continue
            offset = 0
            for i in bucket:
                n = arrays[i].size
                out[i] = flat[offset : offset + n].reshape(arrays[i].shape)
                offset += n
        return out


__all__ = ["GradSync", "SyncStats", "Unreduced", "plan_buckets"]
