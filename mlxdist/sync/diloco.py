"""DiLoCo's outer loop on flat fp32 numpy arrays: the low-communication sync mode.

DiLoCo (arXiv 2311.08105): every rank runs H local optimizer steps on its own data, then
the ranks average their pseudo-gradients (anchor weights minus local weights) and apply
the average to the shared anchor with Nesterov-momentum SGD. The link carries one
model-sized message per H steps instead of one per step. The outer step runs every H
steps on a fraction of the model, so numpy is fast enough and keeps this layer free of
any framework; the bytes move through collectives the caller passes in.

Unequal nodes: each rank's pseudo-gradient is weighted by the samples it processed since
that fragment last synced, so a Studio that did more work counts for more, and the
result does not depend on how the work was split.

All ranks must end with bit-identical anchors. The fp32 wire sums through the caller's
all-reduce (whose result is identical on every rank); lossy wires all-gather the encoded
payloads and every rank decodes and sums them in rank order (the same fp32 operations
in the same order on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..cluster.codec import make_codec
from .fragments import partition, threshold

AllReduceSum = Callable[[list[np.ndarray]], list[np.ndarray]]
AllGather = Callable[[np.ndarray], list[np.ndarray]]

# The fp32 path sends each rank's sample count as two fp32 digits in base 2**20: both
# sums stay exact below 2**24 (16 ranks), and counts up to 2**44 fit.
_DIGIT = 2**20


class OuterOptimizer:
    """SGD with (Nesterov) momentum on pseudo-gradients, torch.optim.SGD semantics
    (no dampening): buf = mu*buf + g; step = g + mu*buf (Nesterov) or buf; p -= lr*step.
    Momentum buffers are kept per parameter index, so fragments step independently."""

    def __init__(self, lr: float, momentum: float, nesterov: bool = True):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buf: dict[int, np.ndarray] = {}

    def step(self, index: int, param: np.ndarray, grad: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """Updates `param` (and the momentum buffer) in place and returns it. The same fp32
        operations in the same order as the textbook expression, so every rank (and the
        reference in the tests) gets the same bits; `scratch` (param's size) spares the
        one temporary, whose page faults cost more than the arithmetic on a big model."""
        if self.momentum:
            mu = np.float32(self.momentum)
            buf = self.buf.get(index)
            if buf is None:
                buf = self.buf[index] = grad.copy()
            else:
                buf *= mu
                buf += grad
            if self.nesterov:
                step = np.multiply(buf, mu, out=scratch)
                step += grad
            else:
                step = np.multiply(buf, np.float32(1), out=scratch)
        else:
            step = np.multiply(grad, np.float32(1), out=scratch)  # grad is the caller's: never touched
        step *= np.float32(self.lr)
        param -= step
        return param

    def state_dict(self) -> dict[str, np.ndarray]:
        # The live buffers (they change in place): the checkpointer writes them out at once.
        return {f"momentum.{i}": b for i, b in sorted(self.buf.items())}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.buf = {int(k.split(".", 1)[1]): np.array(v, np.float32).reshape(-1)
                    for k, v in state.items() if k.startswith("momentum.")}


@dataclass
class Outgoing:
    """One rank's side of a fragment sync, between `take` and `exchange`."""
    fragment: int
    size: int
    samples: int
    inner_steps: int
    delta: np.ndarray | None = None
    payload: np.ndarray | None = None
    prepare_seconds: float = 0.0


@dataclass
class Incoming:
    grad: np.ndarray
    total: int
    bytes: int
    seconds: float


@dataclass
class OuterStats:
    """What one outer sync did, for the metrics (`rank`-labelled by the caller).
    `seconds` is the exchange (wire, and decoding for lossy wires); `prepare_seconds`
    the pseudo-gradient and its encoding, `outer_seconds` the outer step on the anchors:
    the CPU work a sync costs besides the wire; `main_seconds` what the training thread
    spent on it (all of it when blocking; handing over and mixing when overlapped, and
    `wait_seconds` of that waiting for a sync that had not finished when due to land)."""
    fragment: int
    seconds: float
    bytes: int
    pseudo_grad_norm: float
    inner_steps: int
    samples: int
    total_samples: int
    prepare_seconds: float = 0.0
    outer_seconds: float = 0.0
    main_seconds: float = 0.0
    wait_seconds: float = 0.0


class DiLoCo:
    """Anchors, outer momentum, wire residuals and the fragment schedule of one rank.

    Per step of the round the caller calls `advance(samples, inner)`; for each fragment it
    returns, it calls `outer_step(k, local weights of fragment_params(k), ...)` on every
    rank and loads the returned arrays into the model (the inner optimizer state stays).
    A round is `period` steps; a rank may sit some of them out (`inner=0`, no samples:
    the time box), so its inner steps per round can be fewer than the period.
    """

    def __init__(self, weights: Sequence[np.ndarray], *, inner_steps: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, wire: str = "bfloat16", fragments: int = 1):
        if inner_steps < fragments:
            raise ValueError(f"dist.inner_steps={inner_steps} is below dist.fragments={fragments}: "
                             "each fragment needs at least one inner step per round")
        self.shapes = [tuple(np.shape(w)) for w in weights]
        self.anchors = [np.array(w, np.float32).reshape(-1) for w in weights]
        self.groups = partition([a.size for a in self.anchors], fragments)
        self.codec = make_codec(wire)
        self.outer = OuterOptimizer(outer_lr, outer_momentum, nesterov)
        self.period = inner_steps
        self.next_period: int | None = None
        self.cursor = 0
        self.round_steps = 0
        self.samples = [0] * fragments
        self.inner = [0] * fragments  # this rank's inner steps since each fragment last synced
        self.residuals: dict[int, np.ndarray] = {}
        self.last: OuterStats | None = None
        self._pending: set[int] = set()
        self._scratch: dict[tuple, np.ndarray] = {}

    @property
    def fragments(self) -> int:
        return len(self.groups)

    def fragment_params(self, k: int) -> list[int]:
        return self.groups[k]

    def fragment_bytes(self, k: int) -> int:
        """Bytes this rank puts on the wire for fragment k (codec bytes + an 8-byte sample count)."""
        return self.codec.nbytes(sum(self.anchors[i].size for i in self.groups[k])) + 8

    def due(self) -> list[int]:
        """Fragments whose sync is due now (at most one: thresholds are distinct)."""
        if self.round_steps >= threshold(self.cursor, self.period, self.fragments):
            return [self.cursor]
        return []

    def advance(self, samples: int, inner: int = 1) -> list[int]:
        """Count one finished step of the round, in which this rank did `inner` inner steps
        (0: it sat the step out) on `samples` samples; return the fragments due."""
        self.round_steps += 1
        for k in range(self.fragments):
            self.samples[k] += int(samples)
            self.inner[k] += int(inner)
        return self.due()

    def set_period(self, steps: int) -> None:
        """Steps per round from the next round on (now, between rounds)."""
        if steps < self.fragments:
            raise ValueError(f"steps per round ({steps}) below dist.fragments={self.fragments}")
        if self.round_steps == 0 and self.cursor == 0:
            self.period, self.next_period = steps, None
        else:
            self.next_period = steps

    def anchor_weights(self, k: int | None = None) -> list[np.ndarray]:
        """Copies of the anchors (of fragment k, or all), shaped like the model's arrays."""
        idx = range(len(self.anchors)) if k is None else self.groups[k]
        return [self.anchors[i].reshape(self.shapes[i]).copy() for i in idx]

    def take(self, k: int) -> Outgoing:
        """Start a sync of fragment k: its counts, and the schedule moves on at once, so
        inner steps may go on while `prepare`, `exchange` and `finish` run (elsewhere)."""
        if k != self.cursor:
            raise RuntimeError(f"DiLoCo: fragment {k} synced out of turn (expected {self.cursor})")
        if k in self._pending:
            raise RuntimeError(f"DiLoCo: fragment {k} started again before its last sync finished")
        out = Outgoing(k, sum(self.anchors[i].size for i in self.groups[k]), self.samples[k], self.inner[k])
        self._pending.add(k)
        self.samples[k], self.inner[k] = 0, 0
        self.cursor += 1
        if self.cursor == self.fragments:
            self.cursor, self.round_steps = 0, 0
            if self.next_period is not None:
                self.period, self.next_period = self.next_period, None
        return out

    def prepare(self, out: Outgoing, local: Sequence[np.ndarray]) -> Outgoing:
        """This rank's pseudo-gradient of the fragment (anchor - local), encoded for the wire.
        Touches only that fragment's buffers and anchors (may run on a worker thread)."""
        t0 = time.perf_counter()
        k, idx = out.fragment, self.groups[out.fragment]
        if len(local) != len(idx):
            raise ValueError(f"DiLoCo: fragment {k} has {len(idx)} arrays, got {len(local)}")
        delta = self._buffer(("delta", k), out.size)
        offset = 0
        for i, w in zip(idx, local, strict=True):
            n = self.anchors[i].size
            np.subtract(self.anchors[i], np.asarray(w, np.float32).reshape(-1), out=delta[offset: offset + n])
            offset += n
        if self.codec.lossy:
            residual = self.residuals.get(k)
            if residual is None:
                residual = self.residuals[k] = np.zeros(delta.size, np.float32)
            out.payload = np.concatenate([np.array([out.samples], np.int64).view(np.uint8),
                                          self.codec.encode(delta, residual, consume=True)])
        else:
            out.delta = delta
        out.prepare_seconds = time.perf_counter() - t0
        return out

    def begin(self, k: int, local: Sequence[np.ndarray]) -> Outgoing:
        """`take` and `prepare` in one (the blocking sync)."""
        return self.prepare(self.take(k), local)

    def _buffer(self, key: tuple, size: int) -> np.ndarray:
        """A fragment's fp32 work array, reused every round: a fresh model-sized array per
        sync costs its page faults again (2.4 s -> 0.5 s per sync of a 31M model here)."""
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = np.empty(size, np.float32)
        return buf

    def exchange(self, out: Outgoing, allreduce_sum: AllReduceSum, allgather: AllGather | None = None) -> Incoming:
        """The collective part: the sample-weighted mean pseudo-gradient over all ranks.
        Touches only this fragment's buffers, so it may run on a background thread
        (one at a time, in `take` order, on every rank)."""
        t0 = time.perf_counter()
        if out.delta is not None:
            hi, lo = divmod(out.samples, _DIGIT)
            summed, count = allreduce_sum([out.delta * np.float32(out.samples), np.array([hi, lo], np.float32)])
            total = int(count[0]) * _DIGIT + int(count[1])
            g = np.asarray(summed, np.float32) / np.float32(total) if total else np.zeros(out.size, np.float32)
            nbytes = 4 * out.size + 8
        else:
            if allgather is None:
                raise ValueError(f"dist.outer_wire={self.codec.name} needs an all-gather of byte buffers")
            # Buffers of this fragment, reused every round (its next exchange comes after
            # this one has landed); the first payload decodes straight into the sum.
            acc, part = self._buffer(("sum", out.fragment), out.size), self._buffer(("part", out.fragment), out.size)
            total = 0
            for r, p in enumerate(allgather(out.payload)):
                s = int(np.asarray(p[:8]).view(np.int64)[0])
                if r == 0:
                    self.codec.decode(np.asarray(p[8:]), out.size, out=acc)
                    acc *= np.float32(s)
                else:
                    self.codec.decode(np.asarray(p[8:]), out.size, out=part)
                    part *= np.float32(s)
                    acc += part
                total += s
            if total:
                acc /= np.float32(total)
            else:
                acc[...] = 0
            g = acc
            nbytes = out.payload.size
        return Incoming(g, total, nbytes, time.perf_counter() - t0)

    def apply(self, out: Outgoing, inc: Incoming) -> tuple[list[np.ndarray], OuterStats]:
        """One outer step on fragment k's anchors: its new weights and what the sync did.
        Touches only that fragment's anchors and momentum (may run on a worker thread);
        the fragment stays pending until `landed`."""
        t0 = time.perf_counter()
        k = out.fragment
        if inc.total:
            offset = 0
            for i in self.groups[k]:
                n = self.anchors[i].size
                scratch = self._buffer(("part", k), out.size)[:n]  # free again once exchanged
                self.outer.step(i, self.anchors[i], inc.grad[offset: offset + n], scratch)
                offset += n
        stats = OuterStats(k, inc.seconds, inc.bytes, float(np.linalg.norm(inc.grad)), out.inner_steps,
                           out.samples, inc.total, out.prepare_seconds, time.perf_counter() - t0)
        return self.anchor_weights(k), stats

    def landed(self, k: int, stats: OuterStats | None = None) -> None:
        """Fragment k's new weights are in the model (or dropped): its next sync may start."""
        self._pending.discard(k)
        if stats is not None:
            self.last = stats

    def finish(self, out: Outgoing, inc: Incoming) -> list[np.ndarray]:
        """Second half: one outer step on fragment k's anchors; returns its new weights."""
        new, stats = self.apply(out, inc)
        self.landed(out.fragment, stats)
        return new

    def complete(self, out: Outgoing, local: Sequence[np.ndarray], allreduce_sum: AllReduceSum,
                 allgather: AllGather | None = None) -> tuple[list[np.ndarray], OuterStats]:
        """Everything of a sync after `take`, for a worker thread: encode, exchange, outer step."""
        self.prepare(out, local)
        return self.apply(out, self.exchange(out, allreduce_sum, allgather))

    def outer_step(self, k: int, local: Sequence[np.ndarray], allreduce_sum: AllReduceSum,
                   allgather: AllGather | None = None) -> list[np.ndarray]:
        """Sync fragment k, blocking: average the sample-weighted pseudo-gradients over all
        ranks, take one outer step on the anchors, return the new weights of fragment k.

        `local` holds this rank's current weights of `fragment_params(k)`, in that order.
        Every rank must call this for the same fragment (a collective).
        """
        out = self.begin(k, local)
        return self.finish(out, self.exchange(out, allreduce_sum, allgather))

    # Checkpoints. "global.*" is identical on every rank (anchors, momentum, fragment
    # cursor); "rank.*" is this rank's own (wire residuals, samples and inner steps since
    # the last sync, position in the round). All values are numpy arrays, for a
    # safetensors file. Anchors, momentum and residuals are the live arrays (they change
    # in place at the next sync): write them out before training goes on.

    def state_dict(self) -> dict[str, np.ndarray]:
        if self._pending:
            raise RuntimeError(f"DiLoCo: checkpoint with fragment syncs in flight {sorted(self._pending)}; finish them first")
        out: dict[str, np.ndarray] = {f"global.anchor.{i}": a for i, a in enumerate(self.anchors)}
        out.update({f"global.{k}": v for k, v in self.outer.state_dict().items()})
        out["global.cursor"] = np.array([self.cursor, self.fragments], np.int64)
        out.update({f"rank.residual.{k}": r for k, r in sorted(self.residuals.items())})
        out["rank.samples"] = np.array(self.samples, np.int64)
        out["rank.inner"] = np.array(self.inner, np.int64)
        out["rank.round"] = np.array([self.round_steps, self.period, self.next_period or 0], np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray], rank_state: bool = True) -> None:
        """Restore a `state_dict`. With `rank_state=False` (resuming on a different set of
        ranks) only the global part is kept: residuals and sample counts restart at zero
        and the round resumes right after the last completed sync. The caller must then
        load `anchor_weights()` into the model: unsynced local progress is discarded."""
        cursor, fragments = (int(x) for x in state["global.cursor"])
        if fragments != self.fragments:
            raise ValueError(f"checkpoint: DiLoCo state has {fragments} fragments, dist.fragments={self.fragments}; "
                             f"resume with dist.fragments={fragments}")
        anchors = [np.array(state[f"global.anchor.{i}"], np.float32).reshape(-1) for i in range(len(self.anchors))]
        for i, a in enumerate(anchors):
            if a.size != self.anchors[i].size:
                raise ValueError(f"checkpoint: DiLoCo anchor {i} has {a.size} values, the model {self.anchors[i].size}")
        self.anchors = anchors
        self.outer.load_state_dict({k[len("global."):]: v for k, v in state.items() if k.startswith("global.momentum.")})
        self.cursor = cursor
        if rank_state:
            self.residuals = {int(k.rsplit(".", 1)[1]): np.array(v, np.float32)
                              for k, v in state.items() if k.startswith("rank.residual.")}
            self.samples = [int(x) for x in state["rank.samples"]]
            self.round_steps, self.period, nxt = (int(x) for x in state["rank.round"])
            self.next_period = nxt or None
            # Files from before inner steps were counted apart from the round's steps.
            self.inner = ([int(x) for x in state["rank.inner"]] if "rank.inner" in state
                          else [self.round_steps] * self.fragments)
        else:
            self.residuals = {}
            self.samples = [0] * self.fragments
            self.inner = [0] * self.fragments
            self.round_steps = threshold(cursor - 1, self.period, self.fragments) if cursor else 0
