"""Fragment syncs in the background while inner steps go on (Streaming DiLoCo's overlap).

A fragment's pseudo-gradient is encoded at step t, travels on one worker thread, and its
outer step lands at step t + `delay` inner steps; meanwhile training continues on all
weights. The fragment's local weights then become a mix of what they learned in the
meantime and the new anchor: alpha * local + (1 - alpha) * anchor (Streaming DiLoCo's
mixing factor; 0.5 there). With delay 0 the sync is the blocking one and the anchor
replaces the local weights exactly.

The worker runs syncs one at a time in submission order, so every rank issues the
same collectives in the same order; it needs a channel of its own
(`Transport.channel()`) and, under mpi4py, an MPI library with thread support (mpi4py asks
for MPI_THREAD_MULTIPLE by default). It does all of a sync's CPU work too, not only the
wire: the pseudo-gradient, its encoding, the decoding and the outer step (numpy lets go
of the GIL for them). On a big model that work costs as much as the wire (a 135M model:
seconds per sync on this machine), and on a Mac the CPU is idle while the GPU computes.
The training thread only hands over the weights and, when the sync lands, mixes them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .diloco import AllGather, AllReduceSum, DiLoCo, OuterStats, Outgoing


class OverlappedSync:
    """Per inner step: `submit` the fragments `DiLoCo.advance` returned, then apply what
    `ready` hands back. `drain` before a checkpoint or at the end."""

    def __init__(self, dl: DiLoCo, allreduce_sum: AllReduceSum, allgather: AllGather | None = None, *,
                 delay: int = 0, alpha: float = 0.5):
        if delay < 0:
            raise ValueError(f"overlap delay {delay}: must be >= 0 inner steps")
        if delay >= dl.period:
            raise ValueError(f"overlap delay {delay} must be below dist.inner_steps={dl.period}: "
                             "a fragment's sync must land before its next one starts")
        self.dl, self.allreduce_sum, self.allgather = dl, allreduce_sum, allgather
        self.delay, self.alpha = delay, alpha
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="diloco-sync")
        self.pending: deque[tuple[int, Outgoing, Future]] = deque()
        self.steps = 0

    def submit(self, k: int, local: Sequence[np.ndarray]) -> None:
        """Start fragment k's sync from `local` (its arrays as of now; they must not change
        afterwards: pass copies, as `Engine.get_weights` returns)."""
        out = self.dl.take(k)
        fut = self.pool.submit(self.dl.complete, out, local, self.allreduce_sum, self.allgather)
        self.pending.append((self.steps + self.delay, out, fut))

    def step(self) -> None:
        """Count one finished inner step (call before `submit`/`ready` of that step)."""
        self.steps += 1

    def ready(self, fetch: Callable[[list[int]], Sequence[np.ndarray]] | None = None, *,
              drain: bool = False) -> list[tuple[int, list[np.ndarray], OuterStats]]:
        """Finished syncs whose landing step has come (all of them with `drain`): for each,
        the fragment, its new local weights and what the sync did. `fetch(indices)` returns the model's
        current arrays at those parameter indices, which the mix may overwrite; it is called
        only when a sync lands with a delay, so the model is not copied out every step."""
        done = []
        while self.pending and (drain or self.pending[0][0] <= self.steps):
            _, out, fut = self.pending.popleft()
            t0 = time.perf_counter()
            anchors, stats = fut.result()
            stats.wait_seconds = time.perf_counter() - t0
            idx = self.dl.fragment_params(out.fragment)
            if self.delay == 0:
                new = anchors
            else:
                if fetch is None:
                    raise ValueError("OverlappedSync.ready: a delayed sync landed; pass fetch to mix the weights")
                a = np.float32(self.alpha)
                new = []
                # alpha * local + (1 - alpha) * anchor, in place: no model-sized temporaries.
                for x, w in zip(fetch(idx), anchors, strict=True):
                    x = np.asarray(x, np.float32).reshape(w.shape)
                    w *= np.float32(1) - a
                    w += np.multiply(x, a, out=x if x.flags.writeable else None)
                    new.append(w)
            self.dl.landed(out.fragment, stats)
            done.append((out.fragment, new, stats))
        return done

    def forget(self) -> None:
        """Wait for the syncs in flight and drop them (a rollback: every rank restores the
        same checkpoint at the same step, so every rank's worker finishes the same exchanges)."""
        for _, out, fut in self.pending:
            fut.exception()
            self.dl.landed(out.fragment)
        self.pending.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
