"""Data-plane collectives on MLX arrays: sum-all-reduce and broadcast.

Three transports behind one small interface, chosen by `dist.backend`:
- `mpi4py`: arrays become numpy buffers; large ones go through our own pipelined ring
  all-reduce over MPI point-to-point messages, small ones through Open MPI's Allreduce;
- `mlx-mpi`: `mx.distributed` with its MPI backend;
- `mlx-ring`: `mx.distributed` with its TCP ring backend, bootstrapped over mpi4py.
`auto` picks mpi4py: with the ring it measured fastest on loopback and between hosts
on shaped links (`python -m mlxdist.bench_allreduce`; see README, "Choosing a backend").

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

from .world import World

# Below this many bytes an array goes through MPI's Allreduce: latency, not bandwidth,
# decides there, and one collective call beats 2(n-1) ring messages.
RING_MIN_BYTES = 256 * 1024
# Ring segment: small enough that forwarding starts early and the tail is short, large
# enough that per-message costs vanish against the bytes (1 MiB = 8 ms at 1 Gbit/s).
RING_SEGMENT_BYTES = int(os.environ.get("MLXDIST_RING_SEGMENT", 1 << 20))
RING_WINDOW = int(os.environ.get("MLXDIST_RING_WINDOW", 4))


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
    # (step, array, segment index) of every pending request, for the completion handler.
    recv_reqs, recv_meta = [], []
    for s in range(steps):
        chunk = (rank - s - 1) % n
        for a, chunks in segs:
            for k, (lo, hi) in enumerate(chunks[chunk]):
                tag = (s * len(segs) + a) * per_chunk + k
                recv_reqs.append(comm.Irecv(outs[a][lo:hi], source=prv, tag=tag))
                recv_meta.append((s, a, k, lo, hi))
    # Sends wait in order in a queue with only `window` of them in flight: Open MPI
    # interleaves the fragments of all posted sends to a peer, so posting them all at
    # once made every segment finish together at the end of a step and nothing could
    # be forwarded early (measured: 48% of the link limit at 1 Gbit/s, against 90%).
    queue: deque[tuple[np.ndarray, int]] = deque()
    chunk0 = rank % n
    for a, chunks in segs:
        for k, (lo, hi) in enumerate(chunks[chunk0]):
            queue.append((srcs[a][lo:hi], a * per_chunk + k))
    reqs, meta = list(recv_reqs), list(recv_meta)
    in_flight = 0

    def pump() -> None:
        nonlocal in_flight
        while queue and in_flight < window:
            buf, tag = queue.popleft()
            reqs.append(comm.Isend(buf, dest=nxt, tag=tag))
            meta.append(None)
            in_flight += 1

    pump()
    while reqs:
        i = MPI.Request.Waitany(reqs)
        reqs.pop(i)
        m = meta.pop(i)
        if m is None:
            in_flight -= 1
            pump()
            continue
        s, a, k, lo, hi = m
        if s < n - 1:  # reduce-scatter: the peer's partial sum plus my own part
            _add(outs[a][lo:hi], srcs[a][lo:hi], outs[a][lo:hi])
        if s + 1 < steps:
            queue.append((outs[a][lo:hi], ((s + 1) * len(segs) + a) * per_chunk + k))
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

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        return arrays

    def broadcast(self, arrays: list[mx.array], root: int = 0) -> list[mx.array]:
        return arrays


class Mpi4pyCollective(Collective):
    name = "mpi4py"

    def __init__(self, world: World):
        self.world, self.comm = world, world.comm
        self.rank, self.size = world.rank, world.size
        # Its own communicator: ring tags can never match another caller's messages.
        self.ring_comm = world.comm.Dup()

    def all_sum(self, arrays: list[mx.array]) -> list[mx.array]:
        from mpi4py import MPI

        mx.eval(arrays)
        srcs = [_to_numpy(a) for a in arrays]
        outs = [np.empty_like(b) for b in srcs]
        big = [i for i, b in enumerate(srcs) if b.nbytes >= RING_MIN_BYTES]
        small = [i for i, b in enumerate(srcs) if b.nbytes < RING_MIN_BYTES]
        with self.world.watch("gradient all-reduce"):
            reqs = []
            for i in small:
                if srcs[i].dtype == np.uint16:  # MPI cannot sum bfloat16 bits
                    f32 = (srcs[i].astype(np.uint32) << 16).view(np.float32)
                    self.comm.Allreduce(MPI.IN_PLACE, f32, op=MPI.SUM)
                    outs[i] = np.asarray(mx.array(f32).astype(mx.bfloat16).view(mx.uint16))
                else:
                    reqs.append(self.comm.Iallreduce(srcs[i], outs[i], op=MPI.SUM))
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


def resolve_backend(requested: str) -> str:
    return "mpi4py" if requested == "auto" else requested


def make_collective(world: World, backend: str, ring_connections: int = 1) -> Collective:
    if world.size == 1:
        return Collective()
    if backend == "mpi4py":
        return Mpi4pyCollective(world)
    if backend == "mlx-mpi":
        return MLXCollective(world, mx.distributed.init(strict=True, backend="mpi"), "mlx-mpi")
    if backend == "mlx-ring":
        return MLXCollective(world, _ring_group(world, ring_connections), "mlx-ring")
    raise ValueError(f"dist.backend: unknown backend '{backend}'")
