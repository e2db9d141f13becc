"""The data plane: every collective mlxdist needs, on flat buffers, behind one interface.

Strategies and engines' reducers call a `Transport`; nothing outside `cluster/` imports MPI.
One implementation per `dist.backend`:
- `MpiTransport` (`mpi4py`): numpy buffers through Open MPI. Between hosts, large buffers go
  through our pipelined ring (`ring.py`: Open MPI's collectives left a shaped link idle a
  third of the time); on one host Open MPI's shared-memory collectives beat it 2-4x, so they
  take those (small all-reduces, one Reduce per owner, Allgatherv, Gatherv). Half-precision
  wires always take the ring: MPI cannot sum bfloat16 or float16.
- `MlxTransport` (`mlx-mpi`, `mlx-ring`, `mlx-jaccl`): `mx.distributed`'s collectives. MLX
  0.32 has `all_sum` and `all_gather` everywhere but `sum_scatter` only under JACCL
  (PLATFORM_NOTES), and no unequal ranges anywhere: a reduce-scatter is an `all_sum` of which
  each rank keeps its ranges, an unequal all-gather or gather pads every rank's part to the
  largest. mx.distributed cannot duplicate a group for a background thread, so `channel()`
  is an mpi4py one there.
- `Transport` itself: one rank, every collective the identity.
`auto` picks mpi4py: with the ring it measured fastest on loopback and between hosts on
shaped links (`python -m mlxdist.bench allreduce`; docs/performance.md, "Choosing a backend").

In-graph sums (`graph_sum`, `all_sum_in_graph`): a sum that is a node of MLX's lazy graph,
so it may sit inside `mx.compile` (mlx-lm and mlx-examples compile their whole step). MLX's
collectives are graph ops; mpi4py's run on the host and cannot be traced. `mpi4py+mlx-mpi`
and `mpi4py+mlx-ring` (what `mlxdist.mlx.init()` picks by default) keep every host-side
collective on mpi4py, as `auto`, and add an MLX group for the in-graph sums alone.

Buffers are flat numpy arrays: float32, uint16 (bfloat16 bit patterns, summed as bfloat16),
float16, or uint8 payloads (`all_gather_bytes`). What goes on the wire is `codec.py`'s choice.
The MLX engine's gradient sum keeps MLX arrays (`all_sum_arrays`), so an mlx-* backend makes
no numpy round trip. A blocking collective is named to the stall watchdog (`World.watch`);
a channel's are not (its thread is not the one the watchdog names).

Waiting is polite (issue 51): every MPI collective here is nonblocking, waited for by
`world.wait_all` (asleep until the last peer rings this transport's doorbell, then a transfer
that yields the core), never inside Open MPI's busy-polling blocking calls. MLX's collectives
wait inside MLX, spinning: `MlxTransport` first waits politely for every rank over mpi4py, so
only the transfer spins there.

Point to point (`send`, `recv`: a pipeline's activations forward, their gradients back): flat
buffers between two ranks, matched by (source, tag). A send never blocks (the caller keeps the
buffer until its `Sent.wait()`), so two neighbours sending to each other at once (1F1B's
crossing activation and gradient) cannot deadlock. Under mpi4py they are Isend/Irecv waited for
politely by `wait_all`, without the doorbell (it counts collectives, which every rank enters in
one order; a message between two ranks is none of those): a waiting receiver sleeps on short
timers. MLX's `mx.distributed.send`/`recv` exist (0.32) but run inside `mx.eval`, which returns
only when the peer has taken the message: crossing sends there would deadlock, so the mlx-*
transports send over their mpi4py side, as their `channel()` does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from .codec import bf16_bits, bf16_to_f32
from .ring import RING_MIN_BYTES, Ranges, ring_allgather, ring_allreduce, ring_reduce_scatter
from .world import Doorbell, World, arrive, wait_all

if TYPE_CHECKING:
    import mlx.core as mx

BUCKET_ELEMS = 25 * 2**20 // 4  # dist.bucket_mb's default, in fp32 elements


def _mine_of(srcs: list[np.ndarray], owners: list[Ranges], rank: int, out: np.ndarray) -> None:
    """`rank`'s ranges of `srcs`, array after array, into `out`."""
    at = 0
    for src, r in zip(srcs, owners, strict=True):
        lo, hi = r[rank]
        out[at:at + hi - lo] = src[lo:hi]
        at += hi - lo


class Transport:
    """One rank: every collective is the identity. The base of the others, and the interface."""

    name = "single"
    rank, size = 0, 1
    # Whether large arrays go out as they are, without GradSync packing them first: a pack is
    # a full copy of the gradients, which the mpi4py ring does not need.
    direct_min_bytes: int | None = None
    graph_sum = True  # whether `all_sum_in_graph` works (MLX's collectives; not mpi4py's)

    def __init__(self, graph_sum: bool = True):
        # One rank stands in for a backend: it refuses an in-graph sum where that backend
        # would (mpi4py), so a compiled step that runs alone also runs on N ranks.
        self.graph_sum = graph_sum

    def watch(self, what: str, patience: float = 1.0) -> AbstractContextManager:
        """Names a blocking wait to the stall watchdog (`World.watch`); a channel's: nothing."""
        return nullcontext()

    # -- sums ------------------------------------------------------------------------
    def all_sum(self, bufs: list[np.ndarray], what: str = "gradient all-reduce", *, reuse: bool = False,
                identical: bool = False) -> list[np.ndarray]:
        """The sum over ranks of each flat buffer, in buffers distinct from `bufs`. `reuse`:
        the results may be buffers kept for the next call (a fresh one costs a page fault per
        4 KiB, every step); `identical`: every rank must get the same bits (a caller with no
        drift check to repair a difference, DiLoCo's anchors)."""
        return [b.copy() for b in bufs]

    def all_sum_arrays(self, arrays: list[mx.array]) -> list[mx.array]:
        """`all_sum` of MLX arrays (the MLX engine's gradient buckets)."""
        return arrays

    def all_sum_in_graph(self, arrays: list[mx.array]) -> list[mx.array]:
        """The sum over ranks as lazy MLX graph nodes, evaluated by the caller's `mx.eval` on
        every rank: legal inside `mx.compile`. Only where `graph_sum` is true."""
        if not self.graph_sum:
            raise RuntimeError(f"the {self.name} transport has no in-graph sum (graph_sum is false)")
        return arrays

    def reduce_scatter(self, srcs: list[np.ndarray | None], owners: list[Ranges], out: np.ndarray,
                       what: str = "gradient reduce-scatter", *, consume: bool = False,
                       bucket: int = BUCKET_ELEMS) -> None:
        """Sum `srcs` (flat, the same shapes on every rank) over ranks; `owners[a][r]` is rank
        r's [lo, hi) of array a, of any sizes (empty: lo == hi). `out` gets this rank's ranges,
        array after array. `consume`: the list's entries are set to None as each array is
        sent, so the caller's memory can go before the exchange ends; `bucket`: elements per
        message where the transport cuts them."""
        _mine_of(srcs, owners, self.rank, out)

    # -- copies ----------------------------------------------------------------------
    def all_gather(self, outs: list[np.ndarray], owners: list[Ranges], what: str = "weight all-gather", *,
                   bucket: int = BUCKET_ELEMS) -> None:
        """Every rank's ranges `owners[a][r]` of `outs`, in place on their owner, copied in
        place to every rank."""

    def gather(self, mine: np.ndarray, ranges: Ranges, total: int, root: int, what: str = "gather", *,
               bucket: int = BUCKET_ELEMS) -> np.ndarray | None:
        """The flat vector of `total` elements whose rank-r part [lo, hi) = `ranges[r]` each
        rank holds as `mine`, on `root`; None elsewhere."""
        return mine.copy()

    def broadcast(self, bufs: list[np.ndarray], root: int = 0, what: str = "broadcast") -> None:
        """`root`'s buffers into every rank's, in place."""

    def all_gather_bytes(self, payload: np.ndarray) -> list[np.ndarray]:
        """Every rank's payload (uint8, the same size on every rank: the lossy codecs'
        exchange), in rank order; views of a buffer the next call may overwrite."""
        return [np.ascontiguousarray(payload, np.uint8).copy()]

    # -- point to point -------------------------------------------------------------------
    def send(self, buf: np.ndarray, to: int, tag: int = 0, what: str = "send") -> Sent:
        """Start sending flat `buf` to rank `to` under `tag`; never blocks. `buf` must stay as
        it is until the returned handle's `wait()` (or `wait_sent`) says it has left."""
        raise RuntimeError(f"{what}: the {self.name} transport has one rank, no peer to send to")

    def recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> None:
        """Into flat `buf` (size and dtype as the sender's) the message `source` sent under
        `tag`, waiting politely for it (named to the stall watchdog)."""
        raise RuntimeError(f"{what}: the {self.name} transport has one rank, no peer to receive from")

    def post_recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> Sent:
        """`recv` started now and waited for later (its handle's `wait()`): posted early, a
        message can land while the caller computes. `buf` is the caller's, untouched until then."""
        raise RuntimeError(f"{what}: the {self.name} transport has one rank, no peer to receive from")

    def barrier(self, what: str = "barrier") -> None:
        pass

    # -- channels ----------------------------------------------------------------------
    def channel(self, pipelined: bool = False) -> Transport:
        """A transport for one background thread whose messages never meet this one's
        (collective: every rank asks at the same point). `pipelined`: many exchanges run back
        to back (ZeRO-3's stages), so take the ring even on one host."""
        return self

    def exchange(self, nbytes: int, dtype: np.dtype) -> str:
        """In words, what carries a reduce-scatter of `nbytes` of `dtype` (for describe lines)."""
        return "none (one rank)"

    def close(self) -> None:
        pass


class MpiTransport(Transport):
    """mpi4py: the pipelined ring between hosts, Open MPI's collectives on one host."""

    name = "mpi4py"
    direct_min_bytes = RING_MIN_BYTES

    def __init__(self, world: World, comm: Any = None, *, watch: bool = True, hosts: list[str] | None = None,
                 pipelined: bool = False, graph: tuple[Any, str] | None = None):
        # graph: (an mx.distributed group, its backend's name) for the in-graph sums alone
        self.graph_group = graph[0] if graph else None
        self.graph_sum = graph is not None
        if graph:
            self.name = f"mpi4py+{graph[1]}"
        self.world, self._owns = world, comm is not None
        self.comm = comm if comm is not None else world.comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # Its own communicator: ring tags can never match another caller's messages.
        self.ring_comm = self.comm.Dup()
        # Within one host Open MPI's shared-memory collectives beat the ring 2-4x (64 KiB
        # messages through shared memory); the ring pays off where a network link is.
        self.hosts = world.allgather(world.host) if hosts is None else hosts
        self.multi_host = len(set(self.hosts)) > 1
        # Its own: a channel's waits run on another thread than the world's
        self.bell = Doorbell.make(self.comm, self.hosts, world.label)
        self.pipelined, self._watching = pipelined, watch
        self._out_cache: dict[tuple[int, int, str], np.ndarray] = {}
        self._received: dict[int, np.ndarray] = {}

    def watch(self, what: str, patience: float = 1.0) -> AbstractContextManager:
        return self.world.watch(what, patience) if self._watching else nullcontext()

    def _ring_for(self, nbytes: int, dtype: np.dtype) -> bool:
        return np.dtype(dtype) != np.float32 or self.pipelined or (self.multi_host and nbytes >= RING_MIN_BYTES)

    def exchange(self, nbytes: int, dtype: np.dtype) -> str:
        return "pipelined ring" if self._ring_for(nbytes, dtype) else "Open MPI collectives (one host)"

    def _out(self, i: int, like: np.ndarray, reuse: bool) -> np.ndarray:
        if not reuse:
            return np.empty_like(like)
        key = (i, like.size, like.dtype.str)
        buf = self._out_cache.get(key)
        if buf is None:
            buf = self._out_cache[key] = np.empty_like(like)
        return buf

    def all_sum(self, bufs: list[np.ndarray], what: str = "gradient all-reduce", *, reuse: bool = False,
                identical: bool = False) -> list[np.ndarray]:
        from mpi4py import MPI

        if len(self._out_cache) > 4 * len(bufs):  # the caller's layout changed
            self._out_cache.clear()
        outs = [self._out(i, b, reuse) for i, b in enumerate(bufs)]
        # The ring sums every chunk in one fixed order and copies it: identical bits everywhere.
        limit = 0 if identical else RING_MIN_BYTES if self.multi_host else 1 << 62
        big = [i for i, b in enumerate(bufs) if b.nbytes >= limit]
        with self.watch(what):
            reqs, widened = [], []
            for i in (i for i, b in enumerate(bufs) if b.nbytes < limit):
                if bufs[i].dtype == np.uint16:  # MPI cannot sum bfloat16 bits: fp32, rounded back
                    f32 = bf16_to_f32(bufs[i])
                    reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, f32, op=MPI.SUM))
                    widened.append((i, f32))
                else:
                    reqs.append(self.comm.Iallreduce(bufs[i], outs[i], op=MPI.SUM))
            if big:
                ring_allreduce(self.ring_comm, [bufs[i] for i in big], [outs[i] for i in big], bell=self.bell)
            if reqs:  # the same on every rank: the sizes are
                wait_all(reqs, self.bell)
            for i, f32 in widened:
                outs[i] = bf16_bits(f32)
        return outs

    def all_sum_arrays(self, arrays: list[mx.array]) -> list[mx.array]:
        import mlx.core as mx

        mx.eval(arrays)
        outs = self.all_sum([_to_numpy(a) for a in arrays], reuse=True)  # mx.array copies them out
        return [_from_numpy(b, a) for a, b in zip(arrays, outs, strict=True)]

    def all_sum_in_graph(self, arrays: list[mx.array]) -> list[mx.array]:
        if self.graph_group is None:
            return super().all_sum_in_graph(arrays)
        return _graph_all_sum(arrays, self.graph_group)

    def reduce_scatter(self, srcs: list[np.ndarray | None], owners: list[Ranges], out: np.ndarray,
                       what: str = "gradient reduce-scatter", *, consume: bool = False,
                       bucket: int = BUCKET_ELEMS) -> None:
        nbytes = sum(s.nbytes for s in srcs)
        dtype = srcs[0].dtype if srcs else np.dtype(np.float32)
        with self.watch(what):
            if self._ring_for(nbytes, dtype):  # sends everything at once: nothing to let go early
                ring_reduce_scatter(self.ring_comm, srcs, owners, out, bell=self.bell)
            else:
                self._reduce_per_owner(srcs, owners, out, consume, bucket)

    def _reduce_per_owner(self, srcs: list, owners: list[Ranges], out: np.ndarray, consume: bool,
                          bucket: int) -> None:
        """In buckets, each packed owner after owner: one Reduce to each owner. Open MPI's
        Reduce_scatter with unequal counts took 460 ms for 100 MB between two ranks on one
        host, two Reduce calls 78 ms."""
        from mpi4py import MPI

        sizes = [s.size for s in srcs]
        send = np.empty(max(1, min(bucket, sum(sizes))), np.float32)
        at = 0
        for pieces in _buckets(sizes, bucket):
            counts, pos = [0] * self.size, 0
            for o in range(self.size):
                for a, lo, hi in pieces:
                    x, y = max(owners[a][o][0], lo), min(owners[a][o][1], hi)
                    if x < y:
                        send[pos:pos + y - x] = srcs[a][x:y]
                        pos += y - x
                        counts[o] += y - x
            if consume:  # an array whose last element is packed can go
                for a, _, hi in pieces:
                    if hi == sizes[a]:
                        srcs[a] = None
            start, reqs = 0, []
            for o, n in enumerate(counts):
                if n:
                    into = out[at:at + n] if o == self.rank else None
                    reqs.append(self.comm.Ireduce(send[start:start + n], into, op=MPI.SUM, root=o))
                start += n
            if reqs:
                wait_all(reqs, self.bell)  # before `send` is packed again
            at += counts[self.rank]

    def all_gather(self, outs: list[np.ndarray], owners: list[Ranges], what: str = "weight all-gather", *,
                   bucket: int = BUCKET_ELEMS) -> None:
        from mpi4py import MPI

        nbytes = sum(o.nbytes for o in outs)
        with self.watch(what):
            if self._ring_for(nbytes, outs[0].dtype if outs else np.dtype(np.float32)):
                ring_allgather(self.ring_comm, outs, owners, bell=self.bell)
                return
            reqs = []
            for buf, ranges in zip(outs, owners, strict=True):
                for lo in range(0, buf.size, bucket):
                    hi = min(buf.size, lo + bucket)
                    counts, displs = _part(ranges, lo, hi)
                    if any(counts):  # a part of the buffer (ZeRO-1's chunk at a time) skips the rest
                        reqs.append(self.comm.Iallgatherv(MPI.IN_PLACE, [buf[lo:hi], (counts, displs)]))
            if reqs:
                wait_all(reqs, self.bell)

    def gather(self, mine: np.ndarray, ranges: Ranges, total: int, root: int, what: str = "gather", *,
               bucket: int = BUCKET_ELEMS) -> np.ndarray | None:
        full = np.empty(total, mine.dtype) if self.rank == root else None
        my_lo = ranges[self.rank][0]
        with self.watch(what, patience=10):  # peers may wait long here, while rank 0 writes a checkpoint
            reqs = []
            for lo in range(0, total, bucket):
                hi = min(total, lo + bucket)
                counts, displs = _part(ranges, lo, hi)
                at = max(my_lo, lo) - my_lo
                recv = [full[lo:hi], (counts, displs)] if full is not None else None
                reqs.append(self.comm.Igatherv(mine[at:at + counts[self.rank]], recv, root=root))
            if reqs:
                wait_all(reqs, self.bell)
        return full

    def broadcast(self, bufs: list[np.ndarray], root: int = 0, what: str = "broadcast") -> None:
        if bufs:
            with self.watch(what):
                wait_all([self.comm.Ibcast(b, root=root) for b in bufs], self.bell)

    def all_gather_bytes(self, payload: np.ndarray) -> list[np.ndarray]:
        buf = np.ascontiguousarray(payload, np.uint8)
        out = self._received.get(buf.size)  # by payload size: reused, valid until the next call
        if out is None:
            out = self._received[buf.size] = np.empty(self.size * buf.size, np.uint8)
        with self.watch("payload all-gather"):
            wait_all([self.comm.Iallgather(buf, out)], self.bell)
        return list(out.reshape(self.size, buf.size))

    def send(self, buf: np.ndarray, to: int, tag: int = 0, what: str = "send") -> Sent:
        buf = np.ascontiguousarray(buf)  # kept by the handle until it has left
        return Sent([self.comm.Isend(buf, dest=to, tag=tag)], buf, self.watch, what)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> None:
        with self.watch(what):
            wait_all([self.comm.Irecv(buf, source=source, tag=tag)])  # no doorbell: not a collective

    def post_recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> Sent:
        return Sent([self.comm.Irecv(buf, source=source, tag=tag)], buf, self.watch, what, received=True)

    def barrier(self, what: str = "barrier") -> None:
        with self.watch(what):
            arrive(self.comm, self.bell)

    def channel(self, pipelined: bool = False) -> Transport:
        return MpiTransport(self.world, self.comm.Dup(), watch=False, hosts=self.hosts, pipelined=pipelined)

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.ring_comm is not None:
            self.ring_comm.Free()
            self.ring_comm = None
        if self._owns and self.comm is not None:
            self.comm.Free()
            self.comm = None


class Sent:
    """A message in flight: a send (`Transport.send`), whose `wait()` returns once its buffer has
    left, or a posted receive (`post_recv`), whose `wait()` returns once its buffer is filled; the
    buffer's owner must not change, read or drop it before."""

    def __init__(self, requests: list, buf: np.ndarray | None, watch, what: str, received: bool = False):
        self._requests, self._buf, self._watch = requests, buf, watch
        self._what = what if received else f"{what} (waiting for the peer to take it)"

    def done(self) -> bool:
        from mpi4py import MPI

        return not self._requests or bool(MPI.Request.Testall(self._requests))

    def wait(self) -> None:
        if self._requests:
            with self._watch(self._what):
                wait_all(self._requests)
        self._requests, self._buf = [], None


def wait_sent(sent: list[Sent]) -> None:
    """Every send of `sent` to its end."""
    for s in sent:
        s.wait()


def _buckets(sizes: list[int], bucket: int):
    """(array, lo, hi) pieces of the arrays laid end to end, cut every `bucket` elements."""
    pieces, room = [], bucket
    for a, n in enumerate(sizes):
        lo = 0
        while lo < n:
            hi = min(n, lo + room)
            pieces.append((a, lo, hi))
            room -= hi - lo
            lo = hi
            if room == 0:
                yield pieces
                pieces, room = [], bucket
    if pieces:
        yield pieces


def _part(ranges: Ranges, lo: int, hi: int) -> tuple[list[int], list[int]]:
    """Each rank's count and displacement within [lo, hi) of a vector cut by `ranges`."""
    counts = [max(0, min(b, hi) - max(a, lo)) for a, b in ranges]
    displs = [max(a, lo) - lo if c else 0 for (a, _), c in zip(ranges, counts, strict=True)]
    return counts, displs


def _to_numpy(a: mx.array) -> np.ndarray:
    """A zero-copy numpy view of an evaluated MLX array (bfloat16 as its uint16 bits)."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.asarray(a.view(mx.uint16)).reshape(-1)
    return np.asarray(a).reshape(-1)


def _from_numpy(b: np.ndarray, like: mx.array) -> mx.array:
    import mlx.core as mx

    out = mx.array(b)
    if like.dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out.reshape(like.shape)


def _graph_all_sum(arrays: list[mx.array], group: Any) -> list[mx.array]:
    """MLX's all_sum of each array, left lazy: the one place a sum joins MLX's graph."""
    import mlx.core as mx

    return [mx.distributed.all_sum(a, group=group) for a in arrays]


def _to_mx(b: np.ndarray) -> mx.array:
    """A flat wire buffer as an MLX array MLX sums right (uint16 bits as bfloat16)."""
    import mlx.core as mx

    out = mx.array(np.ascontiguousarray(b).reshape(-1))
    return out.view(mx.bfloat16) if b.dtype == np.uint16 else out


def _back(a: mx.array) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


class MlxTransport(Transport):
    """mx.distributed's collectives (mpi, ring or jaccl backend), composed where MLX has none."""

    graph_sum = True

    def __init__(self, world: World, group: Any, name: str):
        self.world, self.group, self.name = world, group, name
        self.rank, self.size = group.rank(), group.size()
        # MLX 0.32: JACCL has sum_scatter; mpi says "not yet implemented", ring "not supported".
        self.sum_scatter = name == "mlx-jaccl"
        # What mx.distributed cannot do (a second channel, identical bits whatever the
        # backend's algorithm) goes over mpi4py, which carries the control plane anyway.
        self.mpi = MpiTransport(world)

    def watch(self, what: str, patience: float = 1.0) -> AbstractContextManager:
        return self.world.watch(what, patience)

    def _run(self, what: str, arrays: list) -> list:
        """Evaluate collectives whose inputs are ready. MLX waits inside its own calls, and
        does not sleep there (its ring retries its sockets, its mpi backend busy-polls Open
        MPI), so every rank first waits politely for the others over mpi4py: what spins in
        MLX is then only the transfer."""
        import mlx.core as mx

        with self.watch(what):
            arrive(self.mpi.comm, self.mpi.bell)
            mx.eval(arrays)  # on every rank (PLATFORM_NOTES: a collective evaluated on one hangs)
        return arrays

    def exchange(self, nbytes: int, dtype: np.dtype) -> str:
        return f"{self.name} sum_scatter" if self.sum_scatter else f"{self.name} all_sum (each rank keeps its ranges)"

    def all_sum_arrays(self, arrays: list[mx.array]) -> list[mx.array]:
        import mlx.core as mx

        mx.eval(arrays)  # computed before the ranks meet, not while a peer waits in MLX
        return self._run("gradient all-reduce", self.all_sum_in_graph(arrays))

    def all_sum_in_graph(self, arrays: list[mx.array]) -> list[mx.array]:
        return _graph_all_sum(arrays, self.group)

    def all_sum(self, bufs: list[np.ndarray], what: str = "gradient all-reduce", *, reuse: bool = False,
                identical: bool = False) -> list[np.ndarray]:
        if identical:
            return self.mpi.all_sum(bufs, what, identical=True)
        import mlx.core as mx

        out = self._run(what, [mx.distributed.all_sum(_to_mx(b), group=self.group) for b in bufs])
        return [_back(o) for o in out]

    def reduce_scatter(self, srcs: list[np.ndarray | None], owners: list[Ranges], out: np.ndarray,
                       what: str = "gradient reduce-scatter", *, consume: bool = False,
                       bucket: int = BUCKET_ELEMS) -> None:
        """Every rank's ranges packed into equal blocks (padded to the largest), block r rank
        r's: JACCL's sum_scatter hands each rank its block; elsewhere each keeps its block of an
        all_sum (no unequal ranges in MLX, and no sum_scatter under mpi or ring)."""
        import mlx.core as mx

        counts = [sum(r[o][1] - r[o][0] for r in owners) for o in range(self.size)]
        width = max(max(counts), 1)
        packed = np.zeros(self.size * width, srcs[0].dtype if srcs else np.float32)
        for o in range(self.size):
            _mine_of(srcs, owners, o, packed[o * width:o * width + counts[o]])
        x = _to_mx(packed)
        if self.sum_scatter:
            part = mx.distributed.sum_scatter(x, group=self.group)
        else:
            part = mx.distributed.all_sum(x, group=self.group)[self.rank * width:(self.rank + 1) * width]
        out[...] = _back(self._run(what, [part])[0])[:counts[self.rank]]

    def _gather_parts(self, mine: np.ndarray, counts: list[int], what: str) -> list[np.ndarray]:
        """Every rank's `mine` (rank r's holds counts[r] elements): all_gather, padded to the
        largest."""
        import mlx.core as mx

        width = max(max(counts), 1)
        padded = np.zeros(width, mine.dtype)
        padded[:mine.size] = mine
        got = _back(self._run(what, [mx.distributed.all_gather(_to_mx(padded), group=self.group)])[0])
        return [got[r * width:r * width + c] for r, c in enumerate(counts)]

    def all_gather(self, outs: list[np.ndarray], owners: list[Ranges], what: str = "weight all-gather", *,
                   bucket: int = BUCKET_ELEMS) -> None:
        if not outs:
            return
        counts = [sum(r[o][1] - r[o][0] for r in owners) for o in range(self.size)]
        mine = np.empty(counts[self.rank], outs[0].dtype)
        _mine_of(outs, owners, self.rank, mine)
        for o, part in enumerate(self._gather_parts(mine, counts, what)):
            at = 0
            for buf, r in zip(outs, owners, strict=True):
                lo, hi = r[o]
                buf[lo:hi] = part[at:at + hi - lo]
                at += hi - lo

    def gather(self, mine: np.ndarray, ranges: Ranges, total: int, root: int, what: str = "gather", *,
               bucket: int = BUCKET_ELEMS) -> np.ndarray | None:
        parts = self._gather_parts(mine, [b - a for a, b in ranges], what)
        if self.rank != root:
            return None
        full = np.empty(total, mine.dtype)
        for (a, b), part in zip(ranges, parts, strict=True):
            full[a:b] = part
        return full

    def broadcast(self, bufs: list[np.ndarray], root: int = 0, what: str = "broadcast") -> None:
        import mlx.core as mx

        # mx.distributed has no broadcast: a sum to which only the root contributes is one.
        keep = self.rank == root
        sent = [_to_mx(b if keep else np.zeros_like(b)) for b in bufs]
        out = self._run(what, [mx.distributed.all_sum(s, group=self.group) for s in sent])
        for b, o in zip(bufs, out, strict=True):
            b.reshape(-1)[...] = _back(o)

    def all_gather_bytes(self, payload: np.ndarray) -> list[np.ndarray]:
        buf = np.ascontiguousarray(payload, np.uint8).reshape(-1)
        return self._gather_parts(buf, [buf.size] * self.size, "payload all-gather")

    def send(self, buf: np.ndarray, to: int, tag: int = 0, what: str = "send") -> Sent:
        """Over mpi4py: MLX's send returns only once the peer took it (module docstring)."""
        return self.mpi.send(buf, to, tag, what)

    def recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> None:
        self.mpi.recv(buf, source, tag, what)

    def post_recv(self, buf: np.ndarray, source: int, tag: int = 0, what: str = "receive") -> Sent:
        return self.mpi.post_recv(buf, source, tag, what)

    def barrier(self, what: str = "barrier") -> None:
        import mlx.core as mx

        self._run(what, [mx.distributed.all_sum(mx.array(0.0), group=self.group)])

    def channel(self, pipelined: bool = False) -> Transport:
        return self.mpi.channel(pipelined)

    def close(self) -> None:
        self.mpi.close()


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
    import mlx.core as mx

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


def sums_in_graph(backend: str) -> bool:
    """Whether `backend` (resolved) can sum inside MLX's graph: every one but plain mpi4py."""
    return backend != "mpi4py"


def auto_with_graph_sums() -> str:
    """What `mlxdist.mlx.init(backend="auto")` means: mpi4py for everything on the host (what
    `auto` measured fastest), plus an MLX group for the in-graph sums of a compiled step: MLX's
    mpi backend where it can load Open MPI (the ranks' own library, `MLX_MPI_LIBNAME`), else
    its ring (TCP, anywhere). Decided before MPI starts: the mpi backend must start it, so a
    process whose mpi4py already did (the script imported `mpi4py.MPI` first) takes the ring."""
    from .world import default_mpi_library, launched_by_mpirun

    if not launched_by_mpirun():
        return "mpi4py+mlx-mpi"  # one rank: nothing is sent, the name only says what can be traced
    if "mpi4py.MPI" in sys.modules:  # MPI_Init twice aborts Open MPI (PLATFORM_NOTES)
        return "mpi4py+mlx-ring"
    os.environ["MLX_MPI_LIBNAME"] = default_mpi_library()
    import mlx.core as mx

    return "mpi4py+mlx-mpi" if mx.distributed.is_available(backend="mpi") else "mpi4py+mlx-ring"


def make_transport(world: World, backend: str, ring_connections: int = 1) -> Transport:
    """The data plane of `dist.backend` (resolved: no `auto`) for this job; collective."""
    if world.size == 1:
        return Transport(graph_sum=sums_in_graph(backend))
    if backend == "mpi4py":
        return MpiTransport(world)
    if backend.startswith("mpi4py+"):
        graph = backend.removeprefix("mpi4py+")
        return MpiTransport(world, graph=(_mlx_group(world, graph, ring_connections), graph))
    if backend in ("mlx-mpi", "mlx-ring", "mlx-jaccl"):
        return MlxTransport(world, _mlx_group(world, backend, ring_connections), backend)
    raise ValueError(f"dist.backend: unknown backend '{backend}'")


def _mlx_group(world: World, backend: str, ring_connections: int) -> Any:
    """The mx.distributed group of an mlx-* backend (the mpi one: MPI already started by
    `init_world`, MLX first)."""
    import mlx.core as mx

    if backend == "mlx-mpi":
        return mx.distributed.init(strict=True, backend="mpi")
    if backend == "mlx-ring":
        return _ring_group(world, ring_connections)
    if backend == "mlx-jaccl":
        from . import jaccl

        return jaccl.bootstrap(world, _my_address(world), os.environ.get("MLXDIST_MLX_HOSTFILE"))
    raise ValueError(f"dist.backend: unknown backend '{backend}'")
