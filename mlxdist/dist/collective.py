"""Data-plane collectives on MLX arrays: sum-all-reduce and broadcast.

Three transports behind one small interface, chosen by `dist.backend`:
- `mpi4py`: arrays become numpy buffers; large ones go through our own pipelined ring
  all-reduce over MPI point-to-point messages, small ones through Open MPI's Allreduce;
- `mlx-mpi`: `mx.distributed` with its MPI backend;
- `mlx-ring`: `mx.distributed` with its TCP ring backend, bootstrapped over mpi4py.
`auto` picks mpi4py: with the ring it measured fastest on loopback and between hosts
on shaped links (`python -m mlxdist.bench allreduce`; see README, "Choosing a backend").

Why our own ring: Open MPI's Allreduce (and Iallreduce, worse) left a shaped 1 Gbit/s
link idle for a third to a half of the time between two hosts. A ring reduce-scatter +
all-gather moves the minimum 2(n-1)/n of the buffer per link, and cutting each chunk
into segments that are forwarded as soon as they are summed keeps both directions of
every link busy from the first byte to the last.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections import deque

import mlx.core as mx
import numpy as np

from .world import World, resolve_backend  # noqa: F401 (re-exported)

# Below this many bytes an array goes through MPI's Allreduce: latency, not bandwidth,
# decides there, and one collective call beats 2(n-1) ring messages.
RING_MIN_BYTES = 256 * 1024
# Ring segment: just under Open MPI's TCP eager limit (64 KiB with its header), so a
# segment goes out at once. Larger ones use the rendezvous protocol, whose handshake
# waits behind the data queued in the other direction of a busy link: with 1 MiB
# segments the ring reached 45-50% of a shaped 1 Gbit/s link, with 64 KiB ones ~90%.
RING_SEGMENT_BYTES = int(os.environ.get("MLXDIST_RING_SEGMENT", 65536 - 256))
# Messages in flight each way: 256 x 64 KiB = 16 MiB, above a 10 Gbit/s link's
# bandwidth-delay product even with a few ms of queueing.
RING_WINDOW = int(os.environ.get("MLXDIST_RING_WINDOW", 256))


def _bf16_add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 sum on uint16 bit patterns (numpy has no bfloat16): widen to fp32, add,
    round to nearest even, as MLX's astype does."""
    s = (a.astype(np.uint32) << 16).view(np.float32) + (b.astype(np.uint32) << 16).view(np.float32)
    u = s.view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(s)
    if nan.any():
        r[nan] = 0x7FC0
    out[...] = r


def _add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    if a.dtype == np.uint16:  # bfloat16 bits
        _bf16_add(a, b, out)
    else:
        np.add(a, b, out=out)


def ring_allreduce(comm, srcs: list[np.ndarray], outs: list[np.ndarray],
                   segment_bytes: int = RING_SEGMENT_BYTES, window: int = RING_WINDOW) -> None:
    """Sum `srcs` over all ranks of `comm` into `outs` (same shapes; flat arrays).

    Reduce-scatter then all-gather around the ring rank -> rank+1, each of the
    2(n-1) steps cut into segments. A segment received in one step is (summed and)
    sent on in the next step at once, so no rank waits for a whole step to finish.
    Every chunk is summed in one fixed order along the ring and then copied to all
    ranks, so all ranks get bit-identical results.
    """
    from mpi4py import MPI

    n, rank = comm.Get_size(), comm.Get_rank()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    steps = 2 * (n - 1)
    # Segment table: (array, chunk -> [(lo, hi), ...]), numbered per chunk position.
    segs: list[tuple[int, list[list[tuple[int, int]]]]] = []
    per_chunk = 0
    for a, src in enumerate(srcs):
        length = src.size
        seg_elems = max(1, segment_bytes // src.itemsize)
        bounds = [length * j // n for j in range(n + 1)]
        chunks = []
        for j in range(n):
            lo, hi = bounds[j], bounds[j + 1]
            chunks.append([(x, min(x + seg_elems, hi)) for x in range(lo, hi, seg_elems)])
        per_chunk = max(per_chunk, max(len(c) for c in chunks))
        segs.append((a, chunks))
    if per_chunk == 0:
        return
    # Receives are posted in step order, `window` ahead of the data; sends wait in a
    # queue with `window` in flight. Bounded lists keep each Waitsome cheap.
    recv_plan = deque()
    for s in range(steps):
        chunk = (rank - s - 1) % n
        for a, chunks in segs:
            for k, (lo, hi) in enumerate(chunks[chunk]):
                recv_plan.append((s, a, k, lo, hi))
    queue: deque[tuple[np.ndarray, int]] = deque()
    chunk0 = rank % n
    for a, chunks in segs:
        for k, (lo, hi) in enumerate(chunks[chunk0]):
            queue.append((srcs[a][lo:hi], a * per_chunk + k))
    reqs: list = []
    meta: list = []
    sends = recvs = 0

    def tag_of(s: int, a: int, k: int) -> int:
        return (s * len(segs) + a) * per_chunk + k

    def pump() -> None:
        nonlocal sends, recvs
        while recv_plan and recvs < window:
            m = recv_plan.popleft()
            reqs.append(comm.Irecv(outs[m[1]][m[3]:m[4]], source=prv, tag=tag_of(*m[:3])))
            meta.append(m)
            recvs += 1
        while queue and sends < window:
            buf, tag = queue.popleft()
            reqs.append(comm.Isend(buf, dest=nxt, tag=tag))
            meta.append(None)
            sends += 1

    pump()
    while reqs:
        done = MPI.Request.Waitsome(reqs) or []
        finished = set(done)
        for i in done:
            m = meta[i]
            if m is None:
                sends -= 1
                continue
            recvs -= 1
            s, a, k, lo, hi = m
            if s < n - 1:  # reduce-scatter: the peer's partial sum plus my own part
                _add(outs[a][lo:hi], srcs[a][lo:hi], outs[a][lo:hi])
            if s + 1 < steps:
                queue.append((outs[a][lo:hi], tag_of(s + 1, a, k)))
        reqs[:] = [r for i, r in enumerate(reqs) if i not in finished]
        meta[:] = [m for i, m in enumerate(meta) if i not in finished]
        pump()


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


class Mpi4pyCollective(Collective):
    name = "mpi4py"
    direct_min_bytes = RING_MIN_BYTES

    def __init__(self, world: World):
        self.world, self.comm = world, world.comm
        self.rank, self.size = world.rank, world.size
        # Its own communicator: ring tags can never match another caller's messages.
        self.ring_comm = world.comm.Dup()
        # Result buffers kept between calls: fresh ones cost a page fault per 4 KiB,
        # which measured slower than the copy itself on large gradients.
        self._out_cache: dict[tuple[int, int, str], np.ndarray] = {}
        # Within one host Open MPI's shared-memory Allreduce beat the ring 2-4x (64 KiB
        # messages through shared memory); the ring pays off where a network link is.
        self.use_ring = len(set(world.allgather(world.host))) > 1

    def _out(self, i: int, like: np.ndarray) -> np.ndarray:
        key = (i, like.size, like.dtype.str)
        buf = self._out_cache.get(key)
        if buf is None:
            buf = self._out_cache[key] = np.empty_like(like)
        return buf

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        from mpi4py import MPI

        mx.eval(arrays)
        srcs = [_to_numpy(a) for a in arrays]
        if len(self._out_cache) > 4 * len(srcs):  # the caller's layout changed
            self._out_cache.clear()
        outs = [self._out(i, b) for i, b in enumerate(srcs)]
        limit = RING_MIN_BYTES if self.use_ring else 1 << 62
        big = [i for i, b in enumerate(srcs) if b.nbytes >= limit]
        small = [i for i, b in enumerate(srcs) if b.nbytes < limit]
        with self.world.watch("gradient all-reduce"):
            reqs = []
            for i in small:
                if srcs[i].dtype == np.uint16:  # MPI cannot sum bfloat16 bits
                    f32 = (srcs[i].astype(np.uint32) << 16).view(np.float32)
                    self.comm.Allreduce(MPI.IN_PLACE, f32, op=MPI.SUM)
                    outs[i] = np.asarray(mx.array(f32).astype(mx.bfloat16).view(mx.uint16))
                elif self.use_ring:
                    reqs.append(self.comm.Iallreduce(srcs[i], outs[i], op=MPI.SUM))
                else:
                    self.comm.Allreduce(srcs[i], outs[i], op=MPI.SUM)
            if big:
                ring_allreduce(self.ring_comm, [srcs[i] for i in big], [outs[i] for i in big])
            MPI.Request.Waitall(reqs)
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
