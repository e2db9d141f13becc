"""Our pipelined ring over mpi4py point-to-point messages: all-reduce, and reduce-scatter and
all-gather with unequal ranges. Numpy only; `transport.MpiTransport` decides when to use it.

Why our own ring: Open MPI's Allreduce (and Iallreduce, worse) left a shaped 1 Gbit/s
link idle for a third to a half of the time between two hosts. A ring reduce-scatter +
all-gather moves the minimum 2(n-1)/n of the buffer per link, and cutting each chunk
into segments that are forwarded as soon as they are summed keeps both directions of
every link busy from the first byte to the last.
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from .codec import bf16_bits, bf16_to_f32
from .world import Doorbell, wait_some

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
    out[...] = bf16_bits(bf16_to_f32(a) + bf16_to_f32(b))


def _add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    if a.dtype == np.uint16:  # bfloat16 bits
        _bf16_add(a, b, out)
    else:
        np.add(a, b, out=out)


def ring_allreduce(comm, srcs: list[np.ndarray], outs: list[np.ndarray],
                   segment_bytes: int = RING_SEGMENT_BYTES, window: int = RING_WINDOW,
                   bell: Doorbell | None = None) -> None:
    """Sum `srcs` over all ranks of `comm` into `outs` (same shapes; flat arrays).

    Reduce-scatter then all-gather around the ring rank -> rank+1, each of the
    2(n-1) steps cut into segments. A segment received in one step is (summed and)
    sent on in the next step at once, so no rank waits for a whole step to finish.
    Every chunk is summed in one fixed order along the ring and then copied to all
    ranks, so all ranks get bit-identical results.
    """
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
    first = True
    while reqs:
        done = wait_some(reqs, bell, fresh=first)  # asleep while nothing arrives (world.POLL_SPIN_S)
        first = False
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


Ranges = list[tuple[int, int]]  # per rank: [lo, hi) of one array that rank owns (empty: lo == hi)


class _Pump:
    """Point-to-point messages of one ring collective: receives posted in plan order and sends
    queued, at most `window` of each in flight, each with a callback when it completes."""

    def __init__(self, comm, window: int, bell: Doorbell | None):
        self.comm, self.window, self.bell = comm, window, bell
        self.recv_plan: deque = deque()  # (make_buffer, source, tag, done(buffer))
        self.send_queue: deque = deque()  # (buffer, dest, tag, done or None)
        self.reqs: list = []
        self.meta: list = []
        self.recvs = self.sends = 0

    def _post(self) -> None:
        while self.recv_plan and self.recvs < self.window:
            make, source, tag, done = self.recv_plan.popleft()
            buf = make()
            self.reqs.append(self.comm.Irecv(buf, source=source, tag=tag))
            self.meta.append((True, buf, done))
            self.recvs += 1
        while self.send_queue and self.sends < self.window:
            buf, dest, tag, done = self.send_queue.popleft()
            self.reqs.append(self.comm.Isend(buf, dest=dest, tag=tag))
            self.meta.append((False, buf, done))
            self.sends += 1

    def run(self) -> None:
        self._post()
        first = True
        while self.reqs:
            finished = set(wait_some(self.reqs, self.bell, fresh=first))
            first = False
            for i in sorted(finished):
                is_recv, buf, done = self.meta[i]
                if is_recv:
                    self.recvs -= 1
                else:
                    self.sends -= 1
                if done is not None:
                    done(buf)
            self.reqs[:] = [r for i, r in enumerate(self.reqs) if i not in finished]
            self.meta[:] = [m for i, m in enumerate(self.meta) if i not in finished]
            self._post()


def _segments(lo: int, hi: int, seg_elems: int) -> list[tuple[int, int]]:
    return [(x, min(x + seg_elems, hi)) for x in range(lo, hi, seg_elems)]


def _tags(owners: list[Ranges], n: int, seg_elems: int):
    """A message's tag from (step, array, segment): unique within one collective."""
    per = max([len(_segments(*r[o], seg_elems)) for r in owners for o in range(n)] + [1])
    return lambda s, a, k: (s * len(owners) + a) * per + k


def ring_reduce_scatter(comm, srcs: list[np.ndarray], owners: list[Ranges], out: np.ndarray,
                        segment_bytes: int = RING_SEGMENT_BYTES, window: int = RING_WINDOW,
                        bell: Doorbell | None = None) -> None:
    """Sum `srcs` (flat arrays, same on every rank) over the ranks of `comm`, each rank
    receiving only the ranges it owns: `owners[a][r]` is rank r's [lo, hi) of array a, of
    any sizes (the sharded strategy sizes them by memory). `out` gets this rank's ranges,
    array after array.

    The ring of `ring_allreduce`'s first half, with unequal chunks: the partial sum of rank
    o's range starts at rank o + 1 and travels n - 1 hops, gaining each rank's part, to end
    at o; segments are forwarded as soon as they are summed. The link from rank r carries
    everything but rank r's own range, so equal ranges move what an all-reduce's first half
    moves, and unequal ones cost the largest share: 0.8/0.2 between two ranks takes 0.8 of
    the buffer's time on the busier direction, where equal halves take 0.5. Partial sums
    pass through a pool of segment buffers (`window` x 2 at most), never a full-size copy.
    """
    n, rank = comm.Get_size(), comm.Get_rank()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    pump = _Pump(comm, window, bell)
    pool: list[np.ndarray] = []
    dtype = srcs[0].dtype if srcs else np.float32
    seg_elems = max(1, segment_bytes // np.dtype(dtype).itemsize)
    tag = _tags(owners, n, seg_elems)
    at, start = 0, []
    for r in owners:
        start.append(at)
        at += r[rank][1] - r[rank][0]
    if at != out.size:
        raise ValueError(f"ring_reduce_scatter: out holds {out.size} elements, this rank owns {at}")
    if n == 1:
        for a, r in enumerate(owners):
            out[start[a]:start[a] + r[0][1] - r[0][0]] = srcs[a][r[0][0]:r[0][1]]
        return

    def from_pool() -> np.ndarray:
        return pool.pop() if pool else np.empty(seg_elems, dtype)

    def forward(s: int, a: int, k: int, lo: int, hi: int):
        def done(buf: np.ndarray) -> None:
            part = buf[:hi - lo]
            _add(part, srcs[a][lo:hi], part)
            pump.send_queue.append((part, nxt, tag(s + 1, a, k), lambda _: pool.append(buf)))
        return done

    def land(a: int, lo: int, hi: int):
        def done(part: np.ndarray) -> None:
            _add(part, srcs[a][lo:hi], part)
        return done

    for a, r in enumerate(owners):  # step 0: my own part of the range owned by the previous rank
        for k, (lo, hi) in enumerate(_segments(*r[prv], seg_elems)):
            pump.send_queue.append((srcs[a][lo:hi], nxt, tag(0, a, k), None))
    for s in range(n - 1):
        owner = (rank - s - 2) % n
        for a, r in enumerate(owners):
            for k, (lo, hi) in enumerate(_segments(*r[owner], seg_elems)):
                if s < n - 2:
                    pump.recv_plan.append((from_pool, prv, tag(s, a, k), forward(s, a, k, lo, hi)))
                else:  # the last hop: my range, summed into `out`
                    view = out[start[a] + lo - r[rank][0]:start[a] + hi - r[rank][0]]
                    pump.recv_plan.append((lambda v=view: v, prv, tag(s, a, k), land(a, lo, hi)))
    pump.run()


def ring_allgather(comm, outs: list[np.ndarray], owners: list[Ranges],
                   segment_bytes: int = RING_SEGMENT_BYTES, window: int = RING_WINDOW,
                   bell: Doorbell | None = None) -> None:
    """Every rank's ranges `owners[a][r]` of `outs` (flat arrays), already in place on their
    owner, copied to every rank: `ring_allreduce`'s second half with unequal chunks, each
    range travelling n - 1 hops from its owner, segments forwarded as they arrive."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n == 1:
        return
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    pump = _Pump(comm, window, bell)
    seg_elems = max(1, segment_bytes // outs[0].itemsize) if outs else 1
    tag = _tags(owners, n, seg_elems)

    def forward(t: int, a: int, k: int):
        return lambda part: pump.send_queue.append((part, nxt, tag(t + 1, a, k), None))

    for a, r in enumerate(owners):
        for k, (lo, hi) in enumerate(_segments(*r[rank], seg_elems)):
            pump.send_queue.append((outs[a][lo:hi], nxt, tag(0, a, k), None))
    for t in range(n - 1):
        owner = (rank - t - 1) % n
        for a, r in enumerate(owners):
            for k, (lo, hi) in enumerate(_segments(*r[owner], seg_elems)):
                view = outs[a][lo:hi]
                pump.recv_plan.append((lambda v=view: v, prv, tag(t, a, k), forward(t, a, k) if t < n - 2 else None))
    pump.run()
